"""A reward worker: takes scoring jobs (lists of items) off the Redis stream and answers them.

Workers are interchangeable consumers of one consumer group, so adding processes
(``rlfleet reward --worker-only``) adds throughput; the read / reclaim / keep-alive / answer loop
is the shared ``rlfleet.common.queue.workers.JobWorker``, so a worker that dies mid-job loses nothing and
a slow user function is never mistaken for a dead worker. Scoring itself is ``BatchScorer``
(the same code the front door runs for a request it keeps in-process).

A job whose caller gave up (withdrawn: ``Producer.withdraw`` stored an answer for it) is
skipped, or its scoring is cancelled mid-way (sandboxed items running are killed).

Items were validated by the front door that queued them; decoding still checks their types,
so a malformed payload fails its job (InvalidArgument) instead of reaching a scorer.
"""

from __future__ import annotations

import asyncio

from rlfleet.common.errors import InvalidArgument
from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.entries import Job
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.common.queue.workers import JobWorker
from rlfleet.reward.batch_scorer import BatchScorer, ScoringLanes
from rlfleet.reward.scorers import ScorerRegistry
from rlfleet.reward.types import ScoreRequest, ScoreResult, decode_requests, encode_results

READ_COUNT = 1  # one job per worker at a time: a job with a hung item delays no other job


class RewardWorker(JobWorker):
    """One consumer of the reward stream; ``run`` loops until ``stop`` is set."""

    def __init__(
        self,
        queue: Consumer,
        registry: ScorerRegistry,
        consumer: str,
        item_timeout_s: float = 10.0,
        reclaim_idle_s: float = 10.0,
        slots: WorkerSlots | None = None,
        lanes: ScoringLanes | None = None,
    ) -> None:
        super().__init__(queue, consumer, reclaim_idle_s, read_count=READ_COUNT, slots=slots)
        self.engine = BatchScorer(registry, item_timeout_s, f"score-{consumer}", lanes)
        self.withdrawn = 0

    @property
    def scored(self) -> int:
        return self.engine.scored

    def close(self) -> None:
        self.engine.close()

    async def handle(self, job: Job) -> bytes:
        """The job's results; InvalidArgument when the job itself is unusable. A job withdrawn
        by its caller is not started, or stops (its answer, b"", is then never stored)."""
        try:
            requests = decode_requests(job.payload)
        except InvalidArgument as exc:
            raise InvalidArgument(f"bad scoring job {job.request_id}: {exc}") from exc
        if await self.queue.answered(job):
            return b""
        scoring = asyncio.create_task(self.engine.score_all(requests))
        watch = asyncio.create_task(self.queue.until_answered(job))
        try:
            await asyncio.wait({scoring, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (scoring, watch):
                task.cancel()
        if not scoring.done() or scoring.cancelled():
            self.withdrawn += 1
            return b""
        return encode_results(scoring.result())

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Score one request; every failure becomes the item's ``error``."""
        return await self.engine.score(request)
