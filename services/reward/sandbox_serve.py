"""What a sandboxed child serving the user's scoring function runs, inside the sandbox.

Why a module of its own: the sandbox (``rlfleet.common.sandbox``) is platform code and knows
nothing of scorers; its ``serve`` mode imports the handler it is told to (this module, named by
``sandbox_pool``) after the child is confined, and feeds it one call per line. ``load`` loads
the user's function the way the in-process path does (``scorers.user``) and returns what the
pool wants to know about it, and the answer to one call: ``{"requests": [...]}`` in,
``{"results": [...]}`` out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfleet.reward.scorers.user import UserFunction, user_scorer
from rlfleet.reward.types import ScoreRequest

ABOUT = ("batched", "is_async", "takes_prompt", "description")


def load(user: UserFunction, loop: Any) -> tuple[dict[str, Any], Callable[[dict], dict]]:
    """(what the function is, the answer to one call); raises when the function won't load."""
    scorer = user_scorer(user)

    def answer(message: dict[str, Any]) -> dict[str, Any]:
        requests = [ScoreRequest.from_dict(item) for item in message["requests"]]
        if scorer.is_async:
            results = loop.run_until_complete(scorer.ascore_many(requests))
        else:
            results = scorer.score_many(requests)
        return {"results": [result.to_dict() for result in results]}

    return {key: getattr(scorer, key) for key in ABOUT}, answer
