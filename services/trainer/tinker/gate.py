"""One training client's calls run in the order its SDK numbered them (``seq_id``).

Why: the SDK sends the chunks of one ``forward_backward`` at once (the first one last) and the
``optim_step`` right behind them, without waiting for answers; they may arrive in any order,
but the optimizer step must see every chunk's gradient, and the next step must not start
before it. The SDK numbers a client's calls 1, 2, 3, ... after ``create_model``; call ``n``
goes once calls ``1 .. n-1`` have gone (or were refused at the door: ``skip``). The service
lets a call go when it is queued on the compute thread, whose queue runs in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

log = logging.getLogger(__name__)

GAP_WAIT_S = 600.0
"""A missing ``seq_id`` (a call lost on the way) holds the ones after it at most this long."""


class SeqGate:
    """Lets call ``seq_id`` through once every smaller one went through or was skipped."""

    def __init__(self, first: int = 1) -> None:
        self.next = first
        self._done: set[int] = set()
        self._moved = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def turn(self, seq_id: int | None) -> AsyncIterator[None]:
        """Hold until it is ``seq_id``'s turn (None: no order, go now); the turn passes on
        when the block ends, whatever its outcome."""
        if seq_id is None:
            yield
            return
        async with self._moved:
            try:
                await asyncio.wait_for(
                    self._moved.wait_for(lambda: self.next >= seq_id), GAP_WAIT_S
                )
            except TimeoutError:
                log.warning(
                    "seq_id %d waited %.0f s for %d: going on", seq_id, GAP_WAIT_S, self.next
                )
                self.next = seq_id
        try:
            yield
        finally:
            await self.skip(seq_id)

    async def skip(self, seq_id: int) -> None:
        """``seq_id`` is done (or will never run): the next ones may go."""
        async with self._moved:
            self._done.add(seq_id)
            while self.next in self._done:
                self._done.discard(self.next)
                self.next += 1
            self._moved.notify_all()
