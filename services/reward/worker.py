"""A reward worker: takes scoring jobs (chunks of items) off the Redis stream and answers them.

Workers are interchangeable consumers of one consumer group, so adding processes
(``rlfleet reward --worker-only``) adds throughput; the read / reclaim / keep-alive / answer loop
is the shared ``rlfleet.common.jobs.JobWorker``, so a worker that dies mid-job loses nothing and
a slow user function is never mistaken for a dead worker. This module only knows how to score.

User code is untrusted for liveness, so it runs in a thread with a per-item timeout (counted
from when the item starts running); a hung function costs one item an error, not the worker.
One item's failure is that item's ``error``; only an unusable job fails as a whole.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.common.jobs import JobWorker
from rlfleet.common.workqueue import Job, WorkQueue
from rlfleet.reward.scorers import Scorer, ScorerRegistry, error_result
from rlfleet.reward.types import ScoreRequest, ScoreResult, decode_requests, encode_results

log = logging.getLogger(__name__)

READ_COUNT = 4  # jobs (chunks) taken, scored and answered together
USER_THREADS = 4


class RewardWorker(JobWorker):
    """One consumer of the reward stream; ``run`` loops until ``stop`` is set."""

    def __init__(
        self,
        queue: WorkQueue,
        registry: ScorerRegistry,
        consumer: str,
        item_timeout_s: float = 10.0,
        reclaim_idle_s: float = 10.0,
    ) -> None:
        super().__init__(queue, consumer, reclaim_idle_s, read_count=READ_COUNT)
        self.registry, self.item_timeout_s = registry, item_timeout_s
        self.scored = 0
        self._threads = ThreadPoolExecutor(USER_THREADS, thread_name_prefix=f"score-{consumer}")
        self._user_slots = asyncio.Semaphore(USER_THREADS)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def handle(self, job: Job) -> bytes:
        """The chunk's results; InvalidArgument when the job itself is unusable."""
        try:
            requests = decode_requests(job.payload)
            for request in requests:
                request.validate()
        except InvalidArgument as exc:
            raise InvalidArgument(f"bad scoring job {job.request_id}: {exc}") from exc
        results = await asyncio.gather(*(self.score(request) for request in requests))
        self.scored += len(results)
        return encode_results(list(results))

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Score one request; every failure becomes the item's ``error``."""
        try:
            scorer = self.registry.select(request)
        except NotFound as exc:
            return error_result(request.id, f"NotFound: {exc}")
        if not scorer.blocking:
            return scorer.score(request)
        async with self._user_slots:  # so the timeout starts when the item does
            return await self._score_in_thread(scorer, request)

    async def _score_in_thread(self, scorer: Scorer, request: ScoreRequest) -> ScoreResult:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._threads, scorer.score, request)
        try:
            return await asyncio.wait_for(future, self.item_timeout_s)
        except TimeoutError:
            log.warning("scorer %s timed out on %s", scorer.name, request.id)
            message = f"scorer {scorer.name} timed out after {self.item_timeout_s:g}s"
            return error_result(request.id, message)
