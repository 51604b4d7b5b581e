"""Lanes: how many slow scoring calls run at once in a process, and who gets the next one.

Why: a lane (a sandboxed child, a thread) is the only thing a slow or hanging item may hold.
Lanes are handed out round-robin among owners (one owner = one job or one request's chunk,
``owned_by``), not first come first served: an item of a 1-item request waits for the next
free lane, not behind the 999 items another caller queued before it.

``ThreadLanes`` runs blocking calls (``reward.sandbox=false`` user functions, the ``math``
built-in) in threads of their own. Python cannot kill a thread, so a call past its timeout is
abandoned: its items get an error, its lane is free at once, and the thread runs on until the
function returns. At most ``max_abandoned`` such threads may be left running; past that, calls
fail at once (``StuckCalls``) until some return, so a function that hangs on every input
costs errors, never the service or unbounded threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

_owner: contextvars.ContextVar[object] = contextvars.ContextVar("lane_owner", default=None)
MAX_ABANDONED = 64


@contextlib.contextmanager
def owned_by(owner: object):
    """Lanes taken inside this block (and tasks started in it) are taken for ``owner``."""
    token = _owner.set(owner)
    try:
        yield
    finally:
        _owner.reset(token)


class FairLanes:
    """``count`` lanes; a waiting owner gets the next free one in turn (round-robin)."""

    def __init__(self, count: int) -> None:
        self.count = self.free = max(1, count)
        self._waiting: OrderedDict[object, deque[asyncio.Future]] = OrderedDict()

    @contextlib.asynccontextmanager
    async def lane(self) -> AsyncIterator[None]:
        await self._acquire(_owner.get())
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, owner: object) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, deque()).append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed a lane just as its caller left: pass it on
            else:
                self._forget(owner, waiter)
            raise

    def _release(self) -> None:
        """Hand the lane to the first owner in turn, who then goes to the back of the line."""
        while self._waiting:
            owner, waiters = next(iter(self._waiting.items()))
            waiter = waiters.popleft()
            if waiters:
                self._waiting.move_to_end(owner)
            else:
                del self._waiting[owner]
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1

    def _forget(self, owner: object, waiter: asyncio.Future) -> None:
        waiters = self._waiting.get(owner)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiting[owner]


class StuckCalls(RuntimeError):
    """Too many abandoned calls are still running: refuse new ones until some return."""


class ThreadLanes:
    """Blocking calls, each in a daemon thread of its own, on ``count`` fair lanes."""

    def __init__(self, count: int, max_abandoned: int = MAX_ABANDONED) -> None:
        self.lanes = FairLanes(count)
        self.max_abandoned, self.abandoned = max_abandoned, 0

    async def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()``'s result; TimeoutError after ``timeout_s`` from when it started (the
        thread is then abandoned), StuckCalls while too many abandoned ones still run."""
        self._refuse_if_stuck()
        async with self.lanes.lane():
            self._refuse_if_stuck()
            done = self._start(fn)
            try:
                return await asyncio.wait_for(asyncio.shield(done), timeout_s)
            except BaseException:  # timed out or cancelled: the thread cannot be stopped
                if not done.done():
                    self._abandon(done)
                raise

    def _refuse_if_stuck(self) -> None:
        if self.abandoned >= self.max_abandoned:
            raise StuckCalls(f"{self.abandoned} timed-out calls are still running in threads")

    def _start(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            outcome: T | BaseException
            try:
                outcome, failed = fn(), False
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
                outcome, failed = exc, True
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, done, outcome, failed)

        threading.Thread(target=run, daemon=True, name="score-call").start()
        return done

    def _abandon(self, done: asyncio.Future) -> None:
        self.abandoned += 1
        done.add_done_callback(self._returned)

    def _returned(self, done: asyncio.Future) -> None:
        self.abandoned -= 1
        if not done.cancelled():
            done.exception()  # retrieved: an abandoned call's error is nobody's to log


def _settle(done: asyncio.Future, outcome: object, failed: bool) -> None:
    if done.done():
        return
    if failed:
        done.set_exception(outcome)  # type: ignore[arg-type]
    else:
        done.set_result(outcome)
