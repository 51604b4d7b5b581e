"""User scoring functions, loaded from a file as verl's ``custom_reward_function`` does.

What the signature says decides how the function is called (``base.Scorer``): a parameter
named ``solution_strs`` marks verl's batch form, ``async def`` is awaited, and ``prompt`` (or
``prompts``) is passed only to a function that names it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from rlfleet.reward.scorers.base import ScoreFn, Scorer

if TYPE_CHECKING:  # not at run time: a sandboxed worker loads this without pydantic
    from rlfleet.common.config import UserScorerConfig


def load_user_function(path: str | Path, name: str) -> ScoreFn:
    """Import ``name`` from the Python file at ``path``.

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


class CallingConvention(TypedDict):
    batched: bool
    is_async: bool
    takes_prompt: bool


def calling_convention(fn: ScoreFn) -> CallingConvention:
    """``batched``, ``is_async`` and ``takes_prompt`` as the function's signature says."""
    params = inspect.signature(fn).parameters
    batched = "solution_strs" in params
    return CallingConvention(
        batched=batched,
        is_async=inspect.iscoroutinefunction(fn),
        takes_prompt=("prompts" if batched else "prompt") in params,
    )


class UserFunction(TypedDict):
    """``UserScorerConfig`` as plain data: what the sandbox pool sends a child, which loads
    the function without pydantic."""

    path: str
    name: str
    reward_kwargs: dict[str, Any]
    data_sources: list[str]


def user_function(config: UserScorerConfig) -> UserFunction:
    return {
        "path": config.path,
        "name": config.name,
        "reward_kwargs": dict(config.reward_kwargs),
        "data_sources": list(config.data_sources),
    }


def user_scorer(user: UserFunction) -> Scorer:
    fn = load_user_function(user["path"], user["name"])
    summary = (fn.__doc__ or "").strip().split("\n")[0]
    return Scorer(
        name=user["name"],
        kind="user",
        fn=fn,
        data_sources=list(user["data_sources"]),
        kwargs=dict(user["reward_kwargs"]),
        description=summary or f"{user['name']} from {user['path']}",
        blocking=True,
        **calling_convention(fn),
    )
