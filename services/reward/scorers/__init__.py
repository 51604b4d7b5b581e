"""Scoring functions and how a request finds its one (verl-compatible user functions too).

``base``: the ``Scorer`` and how its answer becomes a ``ScoreResult``; ``user``: loading a
user's file; ``builtin``: arith, gsm8k, math, exact_match, regex, format, composite;
``code``: a solution run against tests in the sandbox; ``answers``: answer extraction and
equivalence; ``registry``: selection by name/data source.

Names are imported on first use (PEP 562): a sandboxed worker needs only ``base`` and ``user``
and should not pay for sympy and pydantic at every start.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ScoreFn": "base",
    "Scorer": "base",
    "error_result": "base",
    "to_result": "base",
    "builtin_scorers": "builtin",
    "DEFAULT_MARK": "registry",
    "ScorerRegistry": "registry",
    "build_registry": "registry",
    "load_user_function": "user",
    "user_scorer": "user",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
