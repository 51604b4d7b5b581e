"""Scoring functions and how a request finds its one (verl-compatible user functions too).

``base``: the ``Scorer`` and how its answer becomes a ``ScoreResult``; ``user``: loading a
user's file; ``builtin``: arith, gsm8k, math, exact_match, regex, format, composite;
``answers``: answer extraction and equivalence; ``registry``: selection by name/data source.
"""

from rlfleet.reward.scorers.base import ScoreFn, Scorer, error_result, to_result
from rlfleet.reward.scorers.builtin import builtin_scorers
from rlfleet.reward.scorers.registry import DEFAULT_MARK, ScorerRegistry, build_registry
from rlfleet.reward.scorers.user import load_user_function, user_scorer

__all__ = [
    "DEFAULT_MARK",
    "ScoreFn",
    "Scorer",
    "ScorerRegistry",
    "build_registry",
    "builtin_scorers",
    "error_result",
    "load_user_function",
    "to_result",
    "user_scorer",
]
