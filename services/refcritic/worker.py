"""A refcritic worker: takes ref / values jobs off one Redis stream, computes, answers.

Workers of one stream are interchangeable consumers of one group, so more processes
(``rlfleet refcritic --worker-only``) add reference throughput. A worker that dies mid-job
loses nothing: its entry stays pending and a live worker reclaims it once it has been idle for
``refcritic.reclaim_idle_s``. While computing, a worker keeps its entry fresh (``XCLAIM ...
JUSTID`` to itself, not a delivery), so a slow forward is never mistaken for a dead worker.

The model runs in a thread under the process's model lock (shared with the gRPC servicer), so
the event loop stays free for health checks and one computation runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from rlfleet.common.errors import InvalidArgument
from rlfleet.common.job_lease import kept_alive
from rlfleet.common.workqueue import Job, WorkQueue
from rlfleet.refcritic.queue_service import decode_job, encode_rows, error_text

log = logging.getLogger(__name__)

READ_BLOCK_MS = 500
RETRY_AFTER_ERROR_S = 1.0
Compute = Callable[[list[list[int]], list[list[int]]], list[list[float]]]


def consumer_name(kind: str, index: int) -> str:
    """Unique per process and task, so a restarted process never poses as a dead one."""
    return f"{socket.gethostname()}-{os.getpid()}-{kind}-{index}"


@dataclass
class WorkerSettings:
    """How long an idle pending job waits before reclaim, and the testing-only delay."""

    reclaim_idle_s: float = 10.0
    delay_s: float = 0.0


class RefCriticWorker:
    """One consumer of one stream; ``compute`` answers its jobs (RefPolicy / Critic method)."""

    def __init__(
        self,
        queue: WorkQueue,
        compute: Compute,
        lock: threading.Lock,
        consumer: str,
        settings: WorkerSettings | None = None,
    ) -> None:
        self.queue, self.compute, self.lock, self.consumer = queue, compute, lock, consumer
        self.settings = settings or WorkerSettings()
        self.answered = 0
        self._next_reclaim = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        """Serve jobs until ``stop``; Redis errors are logged and retried, never fatal."""
        await self.queue.ensure_group()
        log.info("refcritic worker %s reading %s", self.consumer, self.queue.stream)
        while not stop.is_set():
            try:
                await self.step()
            except (RedisError, OSError) as exc:
                log.warning("worker %s: Redis error (%s), retrying", self.consumer, exc)
                await asyncio.sleep(RETRY_AFTER_ERROR_S)
        log.info("refcritic worker %s stopped after %d jobs", self.consumer, self.answered)

    async def step(self) -> int:
        """Take one job (a reclaimed one first), compute and answer it; returns how many."""
        jobs = await self._reclaim_due()
        if not jobs:
            jobs = await self.queue.read(self.consumer, 1, READ_BLOCK_MS)
        for job in jobs:
            async with kept_alive(
                self.queue, self.consumer, [job.entry_id], self.settings.reclaim_idle_s
            ):
                payload, error = await self._run_job(job)
            await self.queue.complete(job, payload, error)
            self.answered += 1
        return len(jobs)

    async def _reclaim_due(self) -> list[Job]:
        """Every ``reclaim_idle_s / 2``, take over one entry a dead worker left pending."""
        loop, idle_s = asyncio.get_running_loop(), self.settings.reclaim_idle_s
        if loop.time() < self._next_reclaim:
            return []
        self._next_reclaim = loop.time() + max(0.2, idle_s / 2)
        jobs = await self.queue.reclaim(self.consumer, int(idle_s * 1000), 1)
        if jobs:
            log.warning("worker %s reclaimed stalled job %s", self.consumer, jobs[0].request_id)
        return jobs

    async def _run_job(self, job: Job) -> tuple[bytes, str | None]:
        """(rows as JSON, None), or (b"", error text) when the job cannot be answered."""
        try:
            _, prompts, responses = decode_job(job.payload)
            rows = await asyncio.to_thread(self._locked, prompts, responses)
        except InvalidArgument as exc:
            return b"", error_text(exc)
        except Exception as exc:  # noqa: BLE001 - any failure is this job's answer
            log.exception("worker %s failed on %s", self.consumer, job.request_id)
            return b"", error_text(exc)
        return encode_rows(rows), None

    def _locked(self, prompts: list[list[int]], responses: list[list[int]]):
        if self.settings.delay_s > 0:
            time.sleep(self.settings.delay_s)  # testing aid: hold the job so it can be killed
        with self.lock:
            return self.compute(prompts, responses)


class WorkerGroup:
    """Worker tasks of this process; a worker that crashes sets ``on_crash`` (stops the role)."""

    def __init__(self, stop_after_s: float = 5.0) -> None:
        self.tasks: list[asyncio.Task] = []
        self.crashed = False
        self._stop = asyncio.Event()
        self._stop_after_s = stop_after_s

    def add(self, worker: RefCriticWorker, on_crash: Callable[[], None]) -> None:
        task = asyncio.create_task(worker.run(self._stop), name=worker.consumer)
        task.add_done_callback(lambda t: self._on_done(t, on_crash))
        self.tasks.append(task)

    def _on_done(self, task: asyncio.Task, on_crash: Callable[[], None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("refcritic worker %s crashed", task.get_name(), exc_info=task.exception())
            self.crashed = True
            on_crash()

    async def stop(self) -> None:
        """Let workers finish their current job; cancel those still busy after a grace period.

        A cancelled job stays pending in Redis, so another worker reclaims it."""
        self._stop.set()
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=self._stop_after_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
