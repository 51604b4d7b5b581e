"""A gateway session's calls -> the trained records of its episode (``Trajectory`` branches).

Why here, pure: the router records every call of a session as the engine saw it (prompt token
ids, sampled token ids, their log-probs and weight versions), and ``/rl/end_session`` turns
them into what the trainer trains, as ``rlfleet.common.trajectory.Trajectory`` records (the
one record the env role and the trainer read too). How calls become records is the caller's
choice (``agent.multi_call``):

- ``merge_prefixes``: a call whose prompt starts with the previous record's tokens (what an
  agent that appends the assistant's message and the tool replies to its conversation sends,
  with a prefix-stable chat template) extends that record: the tokens between two completions
  (the template's and the tools') masked 0, the sampled ones 1. A call that does not (the
  agent rewrote its history; a completion cut by ``max_tokens`` that the template closes
  differently; a tool message re-rendered) starts a new record, a branch.
- ``every_call``: every call is a record of its own: its prompt, then what it sampled.

Either way every sampled token is in exactly one record, with mask 1, so no call is dropped;
``token_native`` says whether the session was one record under ``merge_prefixes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlfleet.common.config.agent import MultiCall
from rlfleet.common.trajectory import Trajectory
from rlfleet.rollout.types import Completion, GenerateResult


@dataclass
class CallRecord:
    """One recorded generation: what the engine was given and what it sampled."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"
    tool_calls: int = 0
    tool_errors: int = 0
    message: dict[str, Any] = field(default_factory=dict)
    generate_s: float = 0.0  # the router's time for the call (queue, replica, answer)

    @classmethod
    def of(cls, result: GenerateResult, completion: Completion, **parsed: Any) -> CallRecord:
        """The record of one choice (``parsed``: the gateway's finish reason, tool-call counts
        and message)."""
        parsed.setdefault("finish_reason", completion.finish_reason)
        return cls(
            list(result.prompt_token_ids),
            list(completion.token_ids),
            [float(x) for x in completion.logprobs],
            completion.versions(result.weight_version),
            **parsed,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CallRecord:
        return cls(**raw)


def branches_of(
    calls: Sequence[CallRecord], mode: MultiCall = "merge_prefixes"
) -> list[Trajectory]:
    """The calls in order as trained records (see the module doc for ``mode``)."""
    branches: list[Trajectory] = []
    for call in calls:
        if mode == "merge_prefixes" and branches and branches[-1].extended_by(call.prompt_ids):
            branches[-1].add_call(call.prompt_ids, call.token_ids, call.logprobs, call.versions)
        else:
            branches.append(
                Trajectory.of_call(call.prompt_ids, call.token_ids, call.logprobs, call.versions)
            )
    return branches


def is_token_native(calls: Sequence[CallRecord]) -> bool:
    """Whether every call extends the one before it (one record under ``merge_prefixes``)."""
    return len(branches_of(calls)) <= 1


def session_episode(
    session_id: str,
    calls: Sequence[CallRecord],
    reward: float | None,
    mode: MultiCall = "merge_prefixes",
) -> dict[str, Any]:
    """``/rl/end_session``'s answer: the session's calls summed up and its branches."""
    branches = branches_of(calls, mode)
    return {
        "session_id": session_id,
        "reward": reward,
        "num_calls": len(calls),
        "multi_call": mode,
        "token_native": is_token_native(calls),
        "num_branches": len(branches),
        "tool_calls": sum(call.tool_calls for call in calls),
        "tool_errors": sum(call.tool_errors for call in calls),
        "generate_s": sum(call.generate_s for call in calls),
        "messages": [call.message for call in calls if call.message],
        "branches": [branch.to_dict() for branch in branches],
    }
