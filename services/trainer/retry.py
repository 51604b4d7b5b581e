"""Retrying the parts of a training step that only talk to other services.

Why: a training run lasts hours and the services it calls do restart (Redis restarted, a
router replaced). An error that retrying can fix (``Unavailable``, ``DeadlineExceeded``) must
cost a pause, not the run. What is retried is always safe to repeat: the rollout of a step
reuses its request ids, so answers already stored are returned rather than run again, and a
weight push is retried only to the replicas still behind. Errors that retrying cannot fix
(bad input, a failed precondition, a bug) end the run at once, as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rlfleet.common.errors import DeadlineExceeded, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT = (Unavailable, DeadlineExceeded)
FIRST_PAUSE_S, MAX_PAUSE_S = 0.5, 5.0


async def retry_transient(attempt: Callable[[int], Awaitable[T]], budget_s: float, what: str) -> T:
    """``attempt(n)`` (n = 0, 1, ...) until it returns, retrying transient errors with
    exponential backoff while ``budget_s`` lasts; the last error is raised after that.

    The first transient failure is always retried once, however long it took: a first attempt
    that waited out a service's own deadline (a batch entry held by a replica that was killed,
    on a loaded machine) would otherwise spend the whole budget and end the run untried."""
    deadline = time.monotonic() + budget_s
    pause = FIRST_PAUSE_S
    for n in itertools.count():
        try:
            return await attempt(n)
        except TRANSIENT as exc:
            if n > 0 and time.monotonic() + pause > deadline:
                raise
            log.warning(
                "%s failed (%s: %s); retry %d in %.1f s",
                what,
                type(exc).__name__,
                exc,
                n + 1,
                pause,
            )
        await asyncio.sleep(pause)
        pause = min(MAX_PAUSE_S, pause * 2)
    raise AssertionError("unreachable")  # itertools.count never ends; for type checkers
