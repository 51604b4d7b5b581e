"""The job toolkit every pool of queue workers is built from, so each idea has one home.

- ``JobWorker``: one consumer of a queue (``Consumer``): take jobs (a dead consumer's stalled ones
  first, via ``XAUTOCLAIM``), ``handle`` them, answer each with its payload or a coded failure.
  While it works, its jobs are ``kept_alive`` (``XCLAIM ... JUSTID``, not a delivery), so a
  slow job is never mistaken for a dead worker's and the reclaim delay can stay a few seconds.
- ``JobWorkerPool``: the worker tasks of one process; one crashing stops the role (``on_crash``).
- ``ScatterGather``: the producer side (``Producer``): submit a batch's jobs under fresh
  request ids, wait for every answer until one deadline (``Producer.wait_all``), return them in
  order, and drop the stored answers; with ``withdraw``, a caller that gives up takes its
  unanswered jobs back (``Producer.withdraw``), so workers stop working for nobody.
- ``WorkerSlots`` + ``LocalFirst``: a front door that runs workers of the pool itself serves a
  request in-process when one of those workers is idle: no Redis at all. Otherwise (its workers
  busy, or none here because the pool runs ``--worker-only`` elsewhere) the request goes
  through the stream, as one job, or as a few when ``IdleWorkers`` sees several consumers
  waiting (``parts_for``): chunks exist only to spread work, never by a fixed count.

Durability of the local path: Redis buys durability for work that outlives the process that
accepted it; a locally handled request never does. It is answered by the same process that
accepted it, within the same RPC. If that process dies, the caller's RPC fails (UNAVAILABLE)
and the caller retries with the same ids; nothing was stored under them, so nothing is
answered twice and nothing is silently lost. A request sent through the stream keeps the
queue's guarantees (a dead worker's job is reclaimed; the first answer wins).
Local requests and stream jobs share the process's slots: a worker waits for a free slot
before reading more jobs, so while local requests hold every slot new jobs go to other
processes (a read already in flight may still add one job: slots are a bound, not a lock).

Delivery itself (dead-lettering, first answer wins, moving work) is ``rlfleet.common.queue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import TypeVar

from redis.exceptions import RedisError

from rlfleet.common.errors import DeadlineExceeded, ErrorCode
from rlfleet.common.queue.consumer import Consumer
from rlfleet.common.queue.entries import Job
from rlfleet.common.queue.producer import Producer
from rlfleet.common.queue.stream import QueueStream
from rlfleet.common.results import Failure, Result

log = logging.getLogger(__name__)

RETRY_AFTER_ERROR_S = 1.0
MARK_EVERY_S = 1.0  # a waiting worker re-marks itself this often (``IdleWorkers`` fresh_ms: 3 s)
R = TypeVar("R")
T = TypeVar("T")


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
            log.log(self.LIFECYCLE_LEVEL, "worker %s stopped after %d jobs", self.consumer,
                    self.answered)  # fmt: skip

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


class ScatterGather:
    """Producer side of a queue: a batch of payloads in, their answers out, in order.

    Request ids are generated here, never taken from callers: callers reuse ids from batch to
    batch, and the queue treats an id it has answered before as done. At most ``concurrency``
    submits are in flight per producer, across batches. Waiting holds no such slot (a batch
    whose jobs are slow must not keep the next batch from being queued: head-of-line
    blocking): each batch waits on one connection (``Producer.wait_all``).

    ``withdraw``: a batch whose caller gives up (cancelled, timed out) has its unanswered jobs
    withdrawn (``Producer.withdraw``), so workers do not keep scoring for nobody and delay
    everyone behind; ``withdrawn`` counts them. Without it their answers are just dropped.
    """

    def __init__(
        self, queue: Producer, timeout_s: float, workers: str, concurrency: int = 32,
        withdraw: bool = False,
    ) -> None:  # fmt: skip
        self.queue, self.timeout_s, self.workers = queue, timeout_s, workers
        self.withdraw, self.withdrawn = withdraw, 0
        self._slots = asyncio.Semaphore(concurrency)

    async def start(self) -> None:
        await self.queue.ensure_group()

    async def run(self, payloads: list[bytes]) -> list[Result]:
        """Every payload's answer, in order; DeadlineExceeded unless all come within
        ``timeout_s`` (the answers that did come are then dropped, or withdrawn)."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        batch = uuid.uuid4().hex
        ids = [f"{self.queue.group}-{batch}-{i}" for i in range(len(payloads))]
        by_id = dict(zip(ids, payloads, strict=True))
        try:
            epoch = await self.queue.epoch()  # read first: a Redis that loses it is then seen
            await self._submit_all(ids, payloads)
            resubmit = partial(self._resubmit, by_id)  # the server lost them: queue again
            answers = await self.queue.wait_all(ids, deadline, epoch=epoch, resubmit=resubmit)
            results = self._all_answered([answers.get(i) for i in ids])
        except BaseException:
            await self._give_up(ids)
            raise
        await self.queue.forget(ids)
        return results

    async def _submit_all(self, ids: list[str], payloads: list[bytes]) -> None:
        """Queue every job; these submits take the producer's slots."""
        pairs = zip(ids, payloads, strict=True)
        await self._bounded([partial(self.queue.submit, i, p) for i, p in pairs])

    async def _resubmit(self, payloads: dict[str, bytes], lost: list[str]) -> None:
        await self._submit_all(lost, [payloads[i] for i in lost])

    async def _give_up(self, ids: list[str]) -> None:
        """Drop the answers that came; with ``withdraw`` take back the jobs still unanswered
        (shielded: a cancelled caller's work is withdrawn all the same)."""
        if self.withdraw:
            await asyncio.shield(self._withdraw(ids))
        else:
            await self.queue.forget(ids)

    async def _withdraw(self, ids: list[str]) -> None:
        try:
            self.withdrawn += await self.queue.withdraw(ids)
        except Exception as exc:  # noqa: BLE001 - the caller's error matters more than ours
            log.warning("could not withdraw %d job(s): %s", len(ids), exc)

    def _all_answered(self, answers: list[Result | None]) -> list[Result]:
        missing = sum(answer is None for answer in answers)
        if missing:
            raise DeadlineExceeded(
                f"{missing} of {len(answers)} jobs on {self.queue.stream} not answered within "
                f"{self.timeout_s:g}s (are {self.workers} running?)"
            )
        return [answer for answer in answers if answer is not None]

    async def _bounded(self, calls: list[Callable[[], Awaitable[R]]]) -> list[R]:
        """Every call's result, with at most ``concurrency`` of this producer's in flight."""

        async def one(call: Callable[[], Awaitable[R]]) -> R:
            async with self._slots:
                return await call()

        return list(await asyncio.gather(*(one(call) for call in calls)))


class WorkerSlots:
    """This process's workers of one pool as slots, shared by the jobs they take off the stream
    and the requests its front door serves in-process (``LocalFirst``)."""

    def __init__(self, count: int) -> None:
        self.count, self.busy = count, 0
        self._freed = asyncio.Event()

    @property
    def idle(self) -> int:
        return max(0, self.count - self.busy)

    def try_take(self) -> bool:
        """Take an idle slot if there is one (atomic: no await between check and take)."""
        if self.idle == 0:
            return False
        self.busy += 1
        return True

    def release(self) -> None:
        self.busy -= 1
        self._freed.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold a slot even past ``count``: jobs already read must be handled."""
        self.busy += 1
        try:
            yield
        finally:
            self.release()

    async def wait_idle(self) -> None:
        while self.idle == 0:
            self._freed.clear()
            await self._freed.wait()


class LocalFirst:
    """Serve a request in this process when one of its workers is idle, else via the queue.

    ``slots`` None (no workers of the pool here, or local-first switched off) always queues.
    The local path gets the same deadline as the queued one (``DeadlineExceeded``)."""

    def __init__(self, slots: WorkerSlots | None, timeout_s: float) -> None:
        self.slots, self.timeout_s = slots, timeout_s
        self.served_local = self.served_queued = 0

    async def run(self, local: Callable[[], Awaitable[R]], queued: Callable[[], Awaitable[R]]) -> R:
        if self.slots is None or not self.slots.try_take():
            self.served_queued += 1
            return await queued()
        self.served_local += 1
        try:
            return await self._in_time(local)
        finally:
            self.slots.release()

    async def _in_time(self, local: Callable[[], Awaitable[R]]) -> R:
        limit = asyncio.timeout(self.timeout_s)
        try:
            async with limit:
                return await local()
        except TimeoutError as exc:
            if not limit.expired():
                raise
            message = f"not answered in-process within {self.timeout_s:g}s"
            raise DeadlineExceeded(message) from exc


class IdleWorkers:
    """How many consumers of a queue, in any process, wait for work right now: how many parts
    a batch is worth cutting into (``QueueStream.waiting_consumers``), cached ``cache_s``."""

    def __init__(self, queue: QueueStream, fresh_ms: int = 3000, cache_s: float = 1.0) -> None:
        self.queue, self.fresh_ms, self.cache_s = queue, fresh_ms, cache_s
        self._count, self._expires = 0, 0.0

    async def count(self) -> int:
        now = asyncio.get_running_loop().time()
        if now >= self._expires:
            self._count = await self.queue.waiting_consumers(self.fresh_ms)
            self._expires = now + self.cache_s
        return self._count


def parts_for(items: int, idle_workers: int, min_items: int) -> int:
    """Parts to cut ``items`` into: one per idle worker, none under ``min_items``, at least 1."""
    return max(1, min(idle_workers, items // max(1, min_items)))


def split_evenly(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """Consecutive slices of near-equal size (sizes differ by at most one)."""
    size, extra = divmod(len(items), max(1, parts))
    bounds = [i * size + min(i, extra) for i in range(max(1, parts) + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
