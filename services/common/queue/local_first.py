"""Where a front door's request is served: in this process when one of its workers is idle,
else through the queue, cut into as many parts as there are idle workers to take them.

``WorkerSlots`` + ``LocalFirst``: a front door that runs workers of the pool itself serves a
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
Local requests and stream jobs share the process's slots (``workers.JobWorker`` waits for one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

from rlfleet.common.errors import DeadlineExceeded
from rlfleet.common.queue.stream import QueueStream

R = TypeVar("R")
T = TypeVar("T")


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
