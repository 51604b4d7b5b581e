"""Scores a list of requests: the one scoring loop behind a reward worker and the local path.

User code is untrusted for liveness: with ``reward.sandbox`` it runs in sandboxed processes
(``sandbox_pool``), which time, kill and replace what hangs; without, a sync function runs in a
thread and an ``async def`` one on the loop, each under a timeout counted from when the item
starts running, so a hung function costs its items an error, not the process. Built-ins run
inline. When the caller goes away (cancellation), items not started are never started and
sandboxed ones running are killed. A function in verl's batch
form is called once for all of a list's items that select it. One item's failure (no scorer, a
raise, a non-number) is that item's ``error``; nothing here raises for a single bad item.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rlfleet.common.errors import NotFound
from rlfleet.reward.scorers import Scorer, ScorerRegistry, error_result
from rlfleet.reward.types import ScoreRequest, ScoreResult

log = logging.getLogger(__name__)

USER_THREADS = 4
Unit = tuple[Scorer, list[int]]  # a scorer and the positions of the items it scores in one go


class BatchScorer:
    """Scores lists of requests with ``registry``; ``close`` releases its threads."""

    def __init__(
        self, registry: ScorerRegistry, item_timeout_s: float = 10.0, name: str = "score"
    ) -> None:
        self.registry, self.item_timeout_s = registry, item_timeout_s
        self.scored = 0
        self._threads = ThreadPoolExecutor(USER_THREADS, thread_name_prefix=name)
        self._user_slots = asyncio.Semaphore(USER_THREADS)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def score_all(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Every item's result, in order."""
        results: list[ScoreResult | None] = [None] * len(requests)
        units = self._units(requests, results)
        done = await asyncio.gather(*(self._run(s, [requests[i] for i in at]) for s, at in units))
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
        if scorer.sandboxed:  # timed by the sandbox, from when a process takes the item
            return await scorer.ascore_many(requests)
        if not scorer.blocking and not scorer.is_async:
            return scorer.score_many(requests)
        timeout_s = self.item_timeout_s * math.ceil(len(requests) / USER_THREADS)
        if scorer.is_async:
            return await self._timed(scorer, requests, timeout_s, scorer.ascore_many)
        async with self._user_slots:  # so the timeout starts when the item does
            return await self._timed(scorer, requests, timeout_s, self._in_thread(scorer))

    def _in_thread(self, scorer: Scorer) -> Callable[[list[ScoreRequest]], Awaitable]:
        def run(requests: list[ScoreRequest]) -> Awaitable[list[ScoreResult]]:
            loop = asyncio.get_running_loop()
            return loop.run_in_executor(self._threads, scorer.score_many, requests)

        return run

    async def _timed(
        self, scorer: Scorer, requests: list[ScoreRequest], timeout_s: float,
        call: Callable[[list[ScoreRequest]], Awaitable[list[ScoreResult]]],
    ) -> list[ScoreResult]:  # fmt: skip
        try:
            return await asyncio.wait_for(call(requests), timeout_s)
        except TimeoutError:
            log.warning("scorer %s timed out on %s", scorer.name, requests[0].id)
            message = f"scorer {scorer.name} timed out after {timeout_s:g}s"
            return [error_result(r.id, message) for r in requests]
