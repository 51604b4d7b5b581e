"""A reward worker: takes scoring jobs (chunks of items) off the Redis stream and answers them.

Workers are interchangeable consumers of one consumer group, so adding processes
(``rlfleet reward --worker-only``) adds throughput, and a worker that dies mid-job loses
nothing: its entries stay pending and a live worker reclaims them once they have been idle for
``reclaim_idle_s``. A live worker keeps its own entries fresh while it works on them (``XCLAIM
... JUSTID`` to itself, which does not count as a delivery), so slow user functions are never
mistaken for a dead worker and the reclaim delay can stay a few seconds.

User code is untrusted for liveness, so it runs in a thread with a per-item timeout (counted
from when the item starts running); a hung function costs one item an error, not the worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor

from redis.exceptions import RedisError

from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.common.job_lease import kept_alive
from rlfleet.common.workqueue import Job, WorkQueue
from rlfleet.reward.scorers import Scorer, ScorerRegistry, error_result
from rlfleet.reward.types import ScoreRequest, ScoreResult, decode_requests, encode_results

log = logging.getLogger(__name__)

READ_COUNT = 4  # jobs (chunks) taken per read
READ_BLOCK_MS = 500
USER_THREADS = 4
ANSWER_CONCURRENCY = 4  # Redis round trips in flight per worker (with its blocking read: + 1)
RETRY_AFTER_ERROR_S = 1.0


def consumer_name(index: int) -> str:
    """Unique per process and task, so a restarted process never poses as a dead one."""
    return f"{socket.gethostname()}-{os.getpid()}-{index}"


class RewardWorker:
    """One consumer of the reward stream; ``run`` loops until ``stop`` is set."""

    def __init__(
        self,
        queue: WorkQueue,
        registry: ScorerRegistry,
        consumer: str,
        item_timeout_s: float = 10.0,
        reclaim_idle_s: float = 10.0,
    ) -> None:
        self.queue, self.registry, self.consumer = queue, registry, consumer
        self.item_timeout_s = item_timeout_s
        self.reclaim_idle_s = reclaim_idle_s
        self.scored = 0
        self._threads = ThreadPoolExecutor(USER_THREADS, thread_name_prefix=f"score-{consumer}")
        self._user_slots = asyncio.Semaphore(USER_THREADS)
        self._answer_slots = asyncio.Semaphore(ANSWER_CONCURRENCY)
        self._next_reclaim = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        """Serve jobs until ``stop``; Redis errors are logged and retried, never fatal."""
        await self.queue.ensure_group()
        log.info("reward worker %s started", self.consumer)
        try:
            while not stop.is_set():
                await self._step_or_pause()
        finally:
            self._threads.shutdown(wait=False, cancel_futures=True)
            log.info("reward worker %s stopped after %d items", self.consumer, self.scored)

    async def _step_or_pause(self) -> None:
        try:
            await self.step()
        except (RedisError, OSError) as exc:
            log.warning("worker %s: Redis error (%s), retrying", self.consumer, exc)
            await asyncio.sleep(RETRY_AFTER_ERROR_S)

    async def step(self) -> int:
        """Take some jobs (reclaimed ones first), score and answer them; returns how many."""
        jobs = await self._reclaim_due()
        if not jobs:
            jobs = await self.queue.read(self.consumer, READ_COUNT, READ_BLOCK_MS)
        if jobs:
            entry_ids = [job.entry_id for job in jobs]
            async with kept_alive(self.queue, self.consumer, entry_ids, self.reclaim_idle_s):
                results = await asyncio.gather(*(self._run_job(job) for job in jobs))
            await asyncio.gather(*(self._answer(j, r) for j, r in zip(jobs, results, strict=True)))
        return len(jobs)

    async def _reclaim_due(self) -> list[Job]:
        """Every ``reclaim_idle_s / 2``, take over entries a dead worker left pending."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_reclaim:
            return []
        self._next_reclaim = loop.time() + max(0.2, self.reclaim_idle_s / 2)
        jobs = await self.queue.reclaim(self.consumer, int(self.reclaim_idle_s * 1000), READ_COUNT)
        if jobs:
            log.warning("worker %s reclaimed %d stalled job(s)", self.consumer, len(jobs))
        return jobs

    async def _run_job(self, job: Job) -> list[ScoreResult] | str:
        """The chunk's results, or a string when the job itself is unusable."""
        try:
            requests = decode_requests(job.payload)
            for request in requests:
                request.validate()
        except InvalidArgument as exc:
            return f"bad scoring job {job.request_id}: {exc}"
        results = await asyncio.gather(*(self.score(request) for request in requests))
        self.scored += len(results)
        return list(results)

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

    async def _answer(self, job: Job, result: list[ScoreResult] | str) -> None:
        async with self._answer_slots:
            if isinstance(result, str):
                await self.queue.complete(job, b"", error=result)
            else:
                await self.queue.complete(job, encode_results(result))
