"""How a request finds its scorer: by name, by claimed data source, by default, by alias.

Order: an explicit ``scorer`` name; a data source some scorer claims (``arith``, or a user
function's ``data_sources``); the user function that is the default (it names no sources);
a built-in's verl alias (``openai/gsm8k``...); else NotFound naming the known sources.
"""

from __future__ import annotations

import logging

from rlfleet.common.config import RewardConfig
from rlfleet.common.errors import NotFound
from rlfleet.reward.scorers.base import Scorer
from rlfleet.reward.scorers.builtin import builtin_scorers
from rlfleet.reward.scorers.code import code_scorer
from rlfleet.reward.scorers.user import user_function, user_scorer
from rlfleet.reward.types import ScoreRequest, ScorerInfo

log = logging.getLogger(__name__)

DEFAULT_MARK = "*"  # shown in ListScorers for a scorer that takes every unclaimed data source


class ScorerRegistry:
    """Scorers by name, by data source, and an optional default for unclaimed sources."""

    def __init__(self) -> None:
        self._by_name: dict[str, Scorer] = {}
        self._by_source: dict[str, Scorer] = {}
        self._by_alias: dict[str, Scorer] = {}
        self._default: Scorer | None = None

    def add(self, scorer: Scorer, default: bool = False) -> None:
        if scorer.name in self._by_name:
            raise ValueError(f"two scorers named {scorer.name!r}")
        self._by_name[scorer.name] = scorer
        for source in scorer.data_sources:
            if source in self._by_source:
                log.info(
                    "data_source %r: %s replaces %s",
                    source,
                    scorer.name,
                    self._by_source[source].name,
                )
            self._by_source[source] = scorer
        self._by_alias.update(dict.fromkeys(scorer.aliases, scorer))
        if default:
            self._default = scorer

    def select(self, request: ScoreRequest) -> Scorer:
        """Explicit name, claimed source, default, alias (see the module docstring)."""
        if request.scorer:
            return self.named(request.scorer)
        source = request.data_source
        found = self._by_source.get(source) or self._default or self._by_alias.get(source)
        if found is None:
            raise NotFound(
                f"no scorer for data_source {source!r}; known data sources: {self.sources()}"
            )
        return found

    def named(self, name: str) -> Scorer:
        if name not in self._by_name:
            raise NotFound(f"no scorer named {name!r}; known: {self.names()}")
        return self._by_name[name]

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def sources(self) -> list[str]:
        return sorted({*self._by_source, *self._by_alias})

    def list_scorers(self) -> list[ScorerInfo]:
        return [self._info(scorer) for scorer in self._by_name.values()]

    def _info(self, scorer: Scorer) -> ScorerInfo:
        sources = [s for s, owner in self._by_source.items() if owner is scorer]
        if scorer is self._default:
            sources.append(DEFAULT_MARK)
        elif self._default is None:
            sources += [s for s in scorer.aliases if self._by_alias.get(s) is scorer]
        return ScorerInfo(scorer.name, scorer.kind, sources, scorer.description)


def model_scorers(config: RewardConfig) -> list[Scorer]:
    """``judge`` and ``reward_model`` when configured; imported only then (httpx, torch)."""
    scorers = []
    if config.judge is not None:
        from rlfleet.reward.judge import judge_scorer

        scorers.append(judge_scorer(config.judge))
    if config.reward_model is not None:
        from rlfleet.reward.reward_model import reward_model_scorer

        scorers.append(reward_model_scorer(config.reward_model))
    return scorers


def build_registry(config: RewardConfig, sandboxed_user: Scorer | None = None) -> ScorerRegistry:
    """Built-ins, the model scorers configured, plus the configured user function (default when it names no data sources):
    ``sandboxed_user`` when given (``sandbox_pool``), else loaded here to run in threads."""
    registry = ScorerRegistry()
    for scorer in builtin_scorers(config.composite):
        registry.add(scorer)
    registry.add(code_scorer(config.sandbox_limits, config.code_scoring))
    for scorer in model_scorers(config):
        registry.add(scorer)
    if config.custom is not None:
        custom = sandboxed_user or user_scorer(user_function(config.custom))
        registry.add(custom, default=not config.custom.data_sources)
        log.info("user scorer %s loaded from %s", custom.name, config.custom.path)
    registry.named(config.default_scorer)  # a typo fails at start, not on the first request
    return registry
