"""Scoring functions and how a request finds its one.

Every scorer has verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None, **kwargs) -> float | dict`` so a user can point rlfleet at the same file they
use with verl. Built-ins are keyed by ``data_source``; a user function is loaded from a file and
either claims some data sources or becomes the default for all unknown ones.

A scorer that raises or returns something that is not a number gives *that item* an ``error``:
one bad response must not fail a whole batch or take a worker down.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.common.config import RewardConfig, UserScorerConfig
from rlfleet.common.errors import NotFound
from rlfleet.reward.types import ScoreRequest, ScoreResult, ScorerInfo, as_number, finite_metrics
from rlfleet.tasks import arith

log = logging.getLogger(__name__)

ScoreFn = Callable[..., Any]
MAX_ERROR_CHARS = 2000
DEFAULT_MARK = "*"  # shown in ListScorers for a scorer that takes every unclaimed data source


@dataclass
class Scorer:
    """A named scoring function; ``blocking`` ones (user code) run in a thread with a timeout."""

    name: str
    kind: str
    fn: ScoreFn
    data_sources: list[str] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    blocking: bool = True

    def score(self, request: ScoreRequest) -> ScoreResult:
        """Call the function and normalise its answer; never raises."""
        try:
            value = self.fn(
                request.data_source,
                request.solution_str,
                request.ground_truth,
                request.extra_info,
                **self.kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - user code may raise anything
            log.warning("scorer %s raised on %s: %r", self.name, request.id, exc)
            return error_result(request.id, f"scorer {self.name} raised {exc!r}")
        return to_result(request.id, value, self.name)


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


class ScorerRegistry:
    """Scorers by name, by data source, and an optional default for unclaimed sources."""

    def __init__(self) -> None:
        self._by_name: dict[str, Scorer] = {}
        self._by_source: dict[str, Scorer] = {}
        self._default: Scorer | None = None

    def add(self, scorer: Scorer, default: bool = False) -> None:
        if scorer.name in self._by_name:
            raise ValueError(f"two scorers named {scorer.name!r}")
        self._by_name[scorer.name] = scorer
        for source in scorer.data_sources:
            if source in self._by_source:
                log.info("data_source %r: %s replaces %s", source, scorer.name,
                         self._by_source[source].name)  # fmt: skip
            self._by_source[source] = scorer
        if default:
            self._default = scorer

    def select(self, request: ScoreRequest) -> Scorer:
        """Explicit scorer name, else the data source's scorer, else the default."""
        if request.scorer:
            if request.scorer not in self._by_name:
                raise NotFound(f"no scorer named {request.scorer!r}; known: {self.names()}")
            return self._by_name[request.scorer]
        found = self._by_source.get(request.data_source) or self._default
        if found is None:
            raise NotFound(
                f"no scorer for data_source {request.data_source!r}; "
                f"known data sources: {sorted(self._by_source)}"
            )
        return found

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def list_scorers(self) -> list[ScorerInfo]:
        return [self._info(scorer) for scorer in self._by_name.values()]

    def _info(self, scorer: Scorer) -> ScorerInfo:
        sources = [s for s, owner in self._by_source.items() if owner is scorer]
        if scorer is self._default:
            sources.append(DEFAULT_MARK)
        return ScorerInfo(scorer.name, scorer.kind, sources, scorer.description)


def _arith_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **_: Any
) -> float:
    return arith.score(solution_str, ground_truth)


def builtin_scorers() -> list[Scorer]:
    """Scorers that ship with rlfleet: pure, fast Python, so they run inline in a worker."""
    arith_scorer = Scorer(
        name="arith",
        kind="builtin",
        fn=_arith_score,
        data_sources=[arith.DATA_SOURCE],
        description="1.0 if the response starts with the integer ground truth, else 0.0",
        blocking=False,
    )
    return [arith_scorer]


def load_user_function(path: str | Path, name: str) -> ScoreFn:
    """Import ``name`` from the Python file at ``path`` (as verl's custom_reward_function does).

    The module gets a name derived from the file's absolute path, so two files named
    ``reward.py`` never collide in ``sys.modules``.
    """
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"reward function file not found: {file}")
    module_name = "rlfleet_user_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{file} defines no function {name!r}")
    return fn


def user_scorer(config: UserScorerConfig) -> Scorer:
    fn = load_user_function(config.path, config.name)
    return Scorer(
        name=config.name,
        kind="user",
        fn=fn,
        data_sources=list(config.data_sources),
        kwargs=dict(config.reward_kwargs),
        description=(fn.__doc__ or "").strip().split("\n")[0]
        or f"{config.name} from {config.path}",
        blocking=True,
    )


def build_registry(config: RewardConfig) -> ScorerRegistry:
    """Built-ins plus the configured user function (default when it names no data sources)."""
    registry = ScorerRegistry()
    for scorer in builtin_scorers():
        registry.add(scorer)
    if config.custom is not None:
        custom = user_scorer(config.custom)
        registry.add(custom, default=not config.custom.data_sources)
        log.info("user scorer %s loaded from %s", custom.name, config.custom.path)
    return registry
