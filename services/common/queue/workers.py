"""The consumer side every pool of queue workers is built from.

- ``JobWorker``: one consumer of a queue (``Consumer``): take jobs (a dead consumer's stalled ones
  first, via ``XAUTOCLAIM``), ``handle`` them, answer each with its payload or a coded failure.
  While it works, its jobs are ``kept_alive`` (``XCLAIM ... JUSTID``, not a delivery), so a
  slow job is never mistaken for a dead worker's and the reclaim delay can stay a few seconds.
- ``JobWorkerPool``: the worker tasks of one process; one crashing stops the role (``on_crash``).

A worker shares its process's ``WorkerSlots`` (``local_first``) with the requests the front door
serves in-process: it waits for a free slot before reading more jobs, so while local requests
hold every slot new jobs go to other processes (a read already in flight may still add one
job: slots are a bound, not a lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from redis.exceptions import RedisError

from rlfleet.common.errors import ErrorCode
from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.entries import Job
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.common.queue.results import Failure

log = logging.getLogger(__name__)

RETRY_AFTER_ERROR_S = 1.0
MARK_EVERY_S = 1.0  # a waiting worker re-marks itself this often (``IdleWorkers`` fresh_ms: 3 s)


def consumer_name(*labels: object) -> str:
    """Unique per process and task, so a restarted process never poses as a dead one."""
    return "-".join([socket.gethostname(), str(os.getpid()), *map(str, labels)])


@contextlib.asynccontextmanager
async def kept_alive(
    queue: Consumer, consumer: str, jobs: list[Job], reclaim_idle_s: float
) -> AsyncIterator[None]:
    """Within this block, ``jobs`` never look idle for ``reclaim_idle_s`` to other workers."""
    task = asyncio.create_task(_touch_forever(queue, consumer, jobs, reclaim_idle_s / 3))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _touch_forever(queue: Consumer, consumer: str, jobs: list[Job], every_s: float):
    while True:
        await asyncio.sleep(every_s)
        try:
            await queue.touch(consumer, jobs)
        except RedisError as exc:
            log.warning("worker %s could not refresh its jobs: %s", consumer, exc)


class JobWorker:
    """One consumer of one queue; subclasses say how to ``handle`` a job.

    ``read_count`` jobs are taken at a time and handled concurrently; a failure (an exception
    out of ``handle``) becomes that job's answer with the exception's ``ErrorCode``.
    """

    LIFECYCLE_LEVEL = logging.INFO
    """Level of the "started" / "stopped after N jobs" lines (a subclass whose process logs
    them for all its workers at once logs each worker's at DEBUG)."""

    def __init__(
        self,
        queue: Consumer,
        consumer: str,
        reclaim_idle_s: float = 10.0,
        read_count: int = 1,
        read_block_ms: int = 500,
        slots: WorkerSlots | None = None,
    ) -> None:
        self.queue, self.consumer, self.reclaim_idle_s = queue, consumer, reclaim_idle_s
        self.read_count, self.read_block_ms = read_count, read_block_ms
        self.slots = slots or WorkerSlots(1)
        self.answered = 0
        self._next_reclaim = 0.0
        self._marked_until = 0.0  # while marked waiting: when to re-mark (0: not marked)
        self._stop = asyncio.Event()

    async def handle(self, job: Job) -> bytes:
        """The answer's payload; raise (ideally an rlfleet error) to answer with a failure."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the worker holds (threads, say) once ``run`` ends."""

    async def run(self, stop: asyncio.Event) -> None:
        """Serve jobs until ``stop``; Redis errors (an outage longer than the client's own
        retries, see ``redis_client``) are logged and retried, never fatal."""
        log.log(self.LIFECYCLE_LEVEL, "worker %s started on %s", self.consumer, self.queue.stream)
        self._stop = stop
        try:
            while not stop.is_set() and not await self._survive(self.queue.ensure_group()):
                pass
            while not stop.is_set():
                await self._step_or_pause()
        finally:
            self.close()
            with contextlib.suppress(RedisError, OSError):  # a stopped worker waits no more
                await self._say_waiting(False)
            log.log(
                self.LIFECYCLE_LEVEL,
                "worker %s stopped after %d jobs",
                self.consumer,
                self.answered,
            )

    async def _step_or_pause(self) -> None:
        await self._survive(self.step())

    async def _survive(self, call: Awaitable[object]) -> bool:
        """Await ``call``; on a Redis error log it, pause (less if asked to stop), return False."""
        try:
            await call
        except (RedisError, OSError) as exc:
            log.warning("worker %s: Redis error (%s), retrying", self.consumer, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), RETRY_AFTER_ERROR_S)
            return False
        return True

    async def step(self) -> int:
        """Take some jobs (reclaimed ones first), handle and answer them; returns how many.

        Waits first for a free slot, so local requests holding them all leave jobs to others."""
        if self.slots.idle == 0:
            await self._say_waiting(False)
            await self.slots.wait_idle()
        jobs = await self._reclaim_due()
        if not jobs:
            await self._say_waiting(True)
            jobs = await self.read()
        if jobs:
            await self._say_waiting(False)
            with self.slots.held():
                async with kept_alive(self.queue, self.consumer, jobs, self.reclaim_idle_s):
                    answers = await asyncio.gather(*(self._answer_of(job) for job in jobs))
            pairs = zip(jobs, answers, strict=True)
            await asyncio.gather(*(self.queue.complete(job, *answer) for job, answer in pairs))
            self.answered += len(jobs)
        return len(jobs)

    async def read(self) -> list[Job]:
        """New jobs for this consumer, blocking up to ``read_block_ms`` (a subclass may ration
        reads, as the env's lanes do)."""
        return await self.queue.read(self.consumer, self.read_count, self.read_block_ms)

    async def _say_waiting(self, waiting: bool) -> None:
        """Tell producers (``IdleWorkers``) whether this worker waits for work: its own mark,
        since servers disagree on what ``XINFO CONSUMERS`` idle means. Waiting is re-marked
        at most every ``MARK_EVERY_S``; a change is written at once."""
        now = asyncio.get_running_loop().time()
        if waiting and now < self._marked_until:
            return
        if not waiting and self._marked_until == 0.0:
            return
        if waiting:
            await self.queue.mark_waiting(self.consumer)
        else:
            await self.queue.mark_busy(self.consumer)
        self._marked_until = now + MARK_EVERY_S if waiting else 0.0

    async def _reclaim_due(self) -> list[Job]:
        """Every ``reclaim_idle_s / 2``, take over jobs a dead worker left pending."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_reclaim:
            return []
        self._next_reclaim = loop.time() + max(0.2, self.reclaim_idle_s / 2)
        idle_ms = int(self.reclaim_idle_s * 1000)
        jobs = await self.queue.reclaim(self.consumer, idle_ms, self.read_count)
        if jobs:
            ids = ", ".join(job.request_id for job in jobs)
            log.warning("worker %s reclaimed stalled job(s) %s", self.consumer, ids)
        return jobs

    async def _answer_of(self, job: Job) -> tuple[bytes, Failure | None]:
        try:
            return await self.handle(job), None
        except Exception as exc:  # noqa: BLE001 - any failure is this job's answer
            failure = Failure.of(exc)
            if failure.code is ErrorCode.INTERNAL:
                log.exception("worker %s failed on %s", self.consumer, job.request_id)
            return b"", failure


class JobWorkerPool:
    """Worker tasks of this process; one that crashes calls ``on_crash`` (stops the role)."""

    def __init__(self, on_crash: Callable[[], None], stop_after_s: float = 5.0) -> None:
        self.tasks: list[asyncio.Task] = []
        self.crashed = False
        self._on_crash, self._stop_after_s = on_crash, stop_after_s
        self._stop = asyncio.Event()

    def add(self, worker: JobWorker) -> None:
        task = asyncio.create_task(worker.run(self._stop), name=worker.consumer)
        task.add_done_callback(self._on_done)
        self.tasks.append(task)

    def _on_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("worker %s crashed", task.get_name(), exc_info=task.exception())
            self.crashed = True
            self._on_crash()

    async def stop(self) -> None:
        """Let workers finish their current jobs; cancel those still busy after a grace period.

        A cancelled job stays pending in Redis, so another worker reclaims it."""
        self._stop.set()
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=self._stop_after_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
