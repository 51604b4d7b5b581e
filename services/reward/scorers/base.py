"""A scorer: a function plus how to call it, and how its answer becomes a ``ScoreResult``.

Functions are called the way verl calls them, by keyword, so a verl reward file works
unchanged: ``compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=..., **reward_kwargs)``, with ``prompt=`` only when the function names that
parameter. verl's batch form (``data_sources, solution_strs, ground_truths, extra_infos``
lists in, a list out) is called once for many items. Either may be ``async def``.

A function that raises or returns something that is not a number gives *those items* an
``error``: one bad response must not fail a whole batch or take a worker down.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.reward.types import ScoreRequest, ScoreResult, as_number, finite_metrics

log = logging.getLogger(__name__)

ScoreFn = Callable[..., Any]
MAX_ERROR_CHARS = 2000


@dataclass
class Scorer:
    """A named scoring function and its calling convention.

    ``data_sources`` are claimed outright; ``aliases`` (verl's dataset names for a built-in)
    are taken only when no user function is the default. ``blocking`` functions (user code)
    run in a thread with a timeout; ``is_async`` ones are awaited with one; ``sandboxed`` ones
    (``ascore_many``) are awaited as they are: their processes have their own wall clock, and
    so are ``self_timed`` ones (the judge: a timeout per HTTP attempt and a budget per item).
    ``kind`` is ``builtin``, ``user`` or ``model`` (judge, reward model: seconds an item, so
    spread over the workers like user functions, but never on the user functions' lanes)."""

    name: str
    kind: str
    fn: ScoreFn
    data_sources: list[str] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    blocking: bool = True
    batched: bool = False
    is_async: bool = False
    takes_prompt: bool = False
    aliases: list[str] = field(default_factory=list)
    sandboxed: bool = False  # runs in sandboxed processes that enforce their own time limits
    self_timed: bool = False  # enforces its own time limits in-process (the judge)

    def arguments(self, request: ScoreRequest) -> dict[str, Any]:
        args = {
            "data_source": request.data_source,
            "solution_str": request.solution_str,
            "ground_truth": request.ground_truth,
            "extra_info": request.extra_info,
        }
        if self.takes_prompt:
            args["prompt"] = request.prompt
        return {**args, **self.kwargs}

    def batch_arguments(self, requests: Sequence[ScoreRequest]) -> dict[str, Any]:
        args = {
            "data_sources": [r.data_source for r in requests],
            "solution_strs": [r.solution_str for r in requests],
            "ground_truths": [r.ground_truth for r in requests],
            "extra_infos": [r.extra_info for r in requests],
        }
        if self.takes_prompt:
            args["prompts"] = [r.prompt for r in requests]
        return {**args, **self.kwargs}

    def score(self, request: ScoreRequest) -> ScoreResult:
        """One item, for a sync function; never raises."""
        return self.score_many([request])[0]

    def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Items of a sync function (one call if batched); never raises."""
        try:
            if self.batched:
                values = self.fn(**self.batch_arguments(requests))
            else:
                values = [self.fn(**self.arguments(r)) for r in requests]
        except Exception as exc:  # noqa: BLE001 - user code may raise anything
            return self.failed(requests, exc)
        return self.results(requests, values)

    async def ascore_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Items of an ``async def`` function; never raises (but may be cancelled)."""
        try:
            if self.batched:
                values = await self.fn(**self.batch_arguments(requests))
            else:
                values = [await self.fn(**self.arguments(r)) for r in requests]
        except Exception as exc:  # noqa: BLE001 - user code may raise anything
            return self.failed(requests, exc)
        return self.results(requests, values)

    def failed(self, requests: Sequence[ScoreRequest], exc: Exception) -> list[ScoreResult]:
        log.warning("scorer %s raised on %s: %r", self.name, requests[0].id, exc)
        return [error_result(r.id, f"scorer {self.name} raised {exc!r}") for r in requests]

    def results(self, requests: Sequence[ScoreRequest], values: Any) -> list[ScoreResult]:
        if not isinstance(values, list | tuple) or len(values) != len(requests):
            kind = f"{len(values)} answers" if isinstance(values, list | tuple) else "no list"
            message = f"scorer {self.name} returned {kind} for {len(requests)} items"
            return [error_result(r.id, message) for r in requests]
        return [to_result(r.id, v, self.name) for r, v in zip(requests, values, strict=True)]


def to_result(request_id: str, value: Any, scorer_name: str) -> ScoreResult:
    """A float, or a dict with ``score`` plus numeric metrics, as a ScoreResult."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return error_result(request_id, f"scorer {scorer_name} returned a dict without 'score'")
        metrics = finite_metrics({k: v for k, v in value.items() if k != "score"})
        value = value["score"]
    number = as_number(value)
    if number is None or not math.isfinite(number):
        kind = type(value).__name__ if number is None else repr(number)
        return error_result(request_id, f"scorer {scorer_name} returned {kind}, not a number")
    return ScoreResult(id=request_id, score=number, metrics=metrics)


def error_result(request_id: str, message: str) -> ScoreResult:
    return ScoreResult(id=request_id, error=message[:MAX_ERROR_CHARS])
