"""A pool of sandboxed processes serving the user's scoring function, and its Scorer.

Why long-lived children: starting Python and importing the user's module per item costs tens
of milliseconds to seconds; a warm child answers in well under one. The price is that a child
may be left in a bad state, so any call that fails as a process (timed out, crashed, killed by
a limit, or abandoned because its caller was cancelled) kills that child and starts a fresh
one in the background; the item gets an error, the service stays up. A call that waits for a
free child holds nothing while it waits (a cancelled waiter just leaves the queue), and
children are handed out round-robin among callers (``lanes.FairLanes``): a hanging item holds
one child, and a 1-item request gets the next free child, not a place behind a large batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.config import SandboxLimits, UserScorerConfig
from rlfleet.common.sandbox import SandboxError, SandboxProcess
from rlfleet.reward.lanes import FairLanes
from rlfleet.reward.scorers.base import Scorer, error_result
from rlfleet.reward.scorers.user import user_function
from rlfleet.reward.types import ScoreRequest, ScoreResult

log = logging.getLogger(__name__)

RESPAWN_PAUSE_S = 1.0
HANDLER = "rlfleet.reward.sandbox_serve"
"""What each child imports to serve the function (``rlfleet.common.sandbox.child.serve``)."""


class SandboxPool:
    """``limits.workers`` children serving one user function."""

    def __init__(self, user: UserScorerConfig, limits: SandboxLimits) -> None:
        self.user = user_function(user)
        self.limits = limits
        self.about: dict[str, Any] = {}
        self.replaced = self.calls = 0
        self._idle: asyncio.Queue[SandboxProcess] = asyncio.Queue()
        self._turns = FairLanes(max(1, limits.workers))  # whose item gets the next child
        self._children: set[SandboxProcess] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> None:
        """Start every child; ValueError (and nothing left running) if the function won't load."""
        starts = [self._spawn() for _ in range(max(1, self.limits.workers))]
        outcomes = await asyncio.gather(*starts, return_exceptions=True)
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if failure is not None:
            await self.close()
            raise failure
        self.about = outcomes[0].ready  # type: ignore[union-attr]
        spaces = self.about.get("isolation", {}).get("namespaces") or ["none"]
        log.info(
            "%d sandboxed worker(s) for %s (namespaces: %s)",
            len(outcomes),
            self.user["name"],
            "+".join(spaces),
        )

    async def score(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Results for ``requests`` (one call of the function, or one per item inside)."""
        async with self._turns.lane():
            return await self._score_on_a_child(requests)

    async def _score_on_a_child(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        child = await self._idle.get()  # at once, unless a child is being replaced
        self.calls += 1
        try:
            reply = await child.call(
                {"requests": [r.to_dict() for r in requests]}, self.limits.timeout_s
            )
        except SandboxError as exc:
            self._replace(child)
            message = f"sandbox: {self.user['name']} {exc}; its process was replaced"
            return [error_result(r.id, message) for r in requests]
        except BaseException:  # cancelled mid-call: stop the work, not just the wait
            self._replace(child)
            raise
        self._idle.put_nowait(child)
        return _results(requests, reply)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(child.close() for child in list(self._children)))
        self._children.clear()

    async def _spawn(self) -> SandboxProcess:
        label = f"user function {self.user['name']!r}"
        child = await SandboxProcess.start(HANDLER, self.user, self.limits, label)
        self._children.add(child)
        self._idle.put_nowait(child)
        return child

    def _replace(self, child: SandboxProcess) -> None:
        self._children.discard(child)
        self.replaced += 1
        task = asyncio.create_task(self._respawn(child))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _respawn(self, dead: SandboxProcess) -> None:
        """Kill the old child, then start a new one, retrying while the pool is open."""
        await dead.close()
        while not self._closed:
            try:
                await self._spawn()
                return
            except (ValueError, OSError, TimeoutError) as exc:
                log.error("could not restart a sandboxed worker: %s", exc)
                await asyncio.sleep(RESPAWN_PAUSE_S)


def _results(requests: Sequence[ScoreRequest], reply: dict[str, Any]) -> list[ScoreResult]:
    raw = reply.get("results")
    if not isinstance(raw, list) or len(raw) != len(requests):
        return [error_result(r.id, "sandbox: malformed reply") for r in requests]
    results = [ScoreResult.from_dict(item) for item in raw]
    for request, result in zip(requests, results, strict=True):
        result.id = request.id
    return results


@dataclass
class SandboxedScorer(Scorer):
    """The user function as the registry sees it; every call goes to the pool."""

    pool: SandboxPool | None = field(default=None, repr=False)

    def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        raise RuntimeError("a sandboxed scorer is only awaited (ascore_many)")

    async def ascore_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        assert self.pool is not None
        return await self.pool.score(requests)


async def sandboxed_user_scorer(config: UserScorerConfig, limits: SandboxLimits) -> Scorer:
    """Start the pool and describe the function as its children found it."""
    pool = SandboxPool(config, limits)
    await pool.start()
    about = pool.about
    return SandboxedScorer(
        name=config.name,
        kind="user",
        fn=_never_called,
        data_sources=list(config.data_sources),
        kwargs=dict(config.reward_kwargs),
        blocking=True,
        batched=bool(about.get("batched")),
        description=about.get("description") or f"{config.name} from {config.path}",
        sandboxed=True,
        pool=pool,
    )


def _never_called(**_: Any) -> float:
    raise RuntimeError("the sandboxed function runs in its pool")


async def close_scorer(scorer: Scorer | None) -> None:
    """Stop a sandboxed scorer's children (nothing for any other scorer)."""
    if isinstance(scorer, SandboxedScorer) and scorer.pool is not None:
        with contextlib.suppress(Exception):
            await scorer.pool.close()
