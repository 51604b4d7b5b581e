"""Scores a list of requests: the one scoring loop behind a reward worker and the local path.

User code is untrusted for liveness: with ``reward.sandbox`` it runs in sandboxed processes
(``sandbox_pool``), which time, kill and replace what hangs; without, a sync function runs in a
thread of its own (``lanes.ThreadLanes``) and an ``async def`` one on the loop, each under a
timeout counted from when the item starts running, so a hung function costs its items an
error (and, without a sandbox, a thread left running), not the process. Pure-Python built-ins
run inline; blocking built-ins (``math``) run on lanes of their own, so built-in scorers never
wait for user functions. Model scorers (``judge``, ``reward_model``) take seconds an item:
they are spread like user functions, but run on the built-ins' lanes (the reward model) or time
themselves (the judge). Every list scored is one owner of the process's lanes (round-robin,
``lanes.owned_by``): its items never queue behind another caller's whole batch. When the
caller goes away (cancellation), items not started are never started and sandboxed ones
running are killed. A function in verl's batch form is called once for all of a list's items
that select it. One item's failure (no scorer, a raise, a non-number) is that item's
``error``; nothing here raises for a single bad item.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from rlfleet.common.errors import NotFound
from rlfleet.reward.lanes import StuckCalls, ThreadLanes, owned_by
from rlfleet.reward.scorers import Scorer, ScorerRegistry, error_result
from rlfleet.reward.types import ScoreRequest, ScoreResult

log = logging.getLogger(__name__)

USER_THREADS = 4
"""Blocking user-function calls at once per process without a sandbox (and ``math`` calls)."""
Unit = tuple[Scorer, list[int]]  # a scorer and the positions of the items it scores in one go


@dataclass
class ScoringLanes:
    """A process's thread lanes, shared by its front door and its workers: built-ins and
    user functions apart, so a stuck user function never delays a built-in."""

    builtin: ThreadLanes = field(default_factory=lambda: ThreadLanes(USER_THREADS))
    user: ThreadLanes = field(default_factory=lambda: ThreadLanes(USER_THREADS))


def waits_for_nobody(scorer: Scorer) -> bool:
    """A built-in scored in the process that received it, never queued: inline ones, and
    blocking ones on their own lanes. The ``code`` scorer runs programs (seconds): it is
    spread over workers like user functions, and so are model scorers (kind ``model``)."""
    return scorer.kind == "builtin" and not scorer.sandboxed


class BatchScorer:
    """Scores lists of requests with ``registry`` on ``lanes`` (its own when None)."""

    def __init__(
        self,
        registry: ScorerRegistry,
        item_timeout_s: float = 10.0,
        name: str = "score",
        lanes: ScoringLanes | None = None,
    ) -> None:
        self.registry, self.item_timeout_s, self.name = registry, item_timeout_s, name
        self.lanes = lanes or ScoringLanes()
        self.scored = 0

    def close(self) -> None:
        """Nothing to release: abandoned calls' threads are daemons and end with the process."""

    async def score_all(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Every item's result, in order; this list is one owner of the lanes."""
        results: list[ScoreResult | None] = [None] * len(requests)
        units = self._units(requests, results)
        with owned_by(object()):
            runs = [self._run(s, [requests[i] for i in at]) for s, at in units]
            done = await asyncio.gather(*runs)
        for (_, at), unit_results in zip(units, done, strict=True):
            for index, result in zip(at, unit_results, strict=True):
                results[index] = result
        self.scored += len(requests)
        return [r for r in results if r is not None]

    async def score(self, request: ScoreRequest) -> ScoreResult:
        return (await self.score_all([request]))[0]

    def _units(self, requests: Sequence[ScoreRequest], results: list) -> list[Unit]:
        """One unit per item, except one per batch-form scorer; NotFound is filled in now."""
        units: list[Unit] = []
        batched: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            try:
                scorer = self.registry.select(request)
            except NotFound as exc:
                results[index] = error_result(request.id, f"NotFound: {exc}")
                continue
            if not scorer.batched:
                units.append((scorer, [index]))
            elif scorer.name not in batched:
                units.append((scorer, batched.setdefault(scorer.name, [index])))
            else:
                batched[scorer.name].append(index)
        return units

    async def _run(self, scorer: Scorer, requests: list[ScoreRequest]) -> list[ScoreResult]:
        if scorer.sandboxed or scorer.self_timed:  # timed by the sandbox or by the scorer
            return await scorer.ascore_many(requests)
        if not scorer.blocking and not scorer.is_async:
            return scorer.score_many(requests)
        timeout_s = self.item_timeout_s * math.ceil(len(requests) / USER_THREADS)
        try:
            if scorer.is_async:
                return await asyncio.wait_for(scorer.ascore_many(requests), timeout_s)
            lanes = self.lanes.user if scorer.kind == "user" else self.lanes.builtin
            return await lanes.call(partial(scorer.score_many, requests), timeout_s)
        except TimeoutError:
            log.warning("scorer %s timed out on %s", scorer.name, requests[0].id)
            message = f"scorer {scorer.name} timed out after {timeout_s:g}s"
        except StuckCalls as exc:
            message = f"scorer {scorer.name} not called: {exc}"
        return [error_result(r.id, message) for r in requests]
