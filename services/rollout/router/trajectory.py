"""A gateway session's calls -> Episode-shaped records (verl's AgentLoopOutput fields).

Why here, pure: the router records every call of a session as the engine saw it (prompt token
ids, sampled token ids, their log-probs and weight versions), and ``/rl/end_session`` turns
them into what the trainer trains. Token-native when each call's prompt starts with the
previous call's prompt and completion (what an agent that appends the assistant's message and
the tool replies to its conversation sends, with a prefix-stable chat template): then the
whole session is ONE record, the tokens between two completions (the template's and the
tools') masked 0, the sampled ones 1, so the trained tokens are exactly the sampled ones.
When a prompt does not extend the previous call (the agent rewrote its history, or the
template re-renders an earlier turn differently from what was sampled), that call starts a
new segment; ``token_native`` is then false and the caller decides what to train.

A record has ``Episode``'s field names (``rlfleet.agent.episode``; the router may not import
that role, so the fields are written here and the env worker validates them on arrival).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlfleet.rollout.types import Completion, GenerateResult

NO_VERSION = -1  # Episode's version of a position that was not sampled


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
        and message); per-token versions when the engine reports them."""
        versions = getattr(completion, "weight_versions", None) or (
            [result.weight_version] * len(completion.token_ids)
        )
        parsed.setdefault("finish_reason", completion.finish_reason)
        return cls(list(result.prompt_token_ids), list(completion.token_ids),
                   [float(x) for x in completion.logprobs], list(versions), **parsed)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CallRecord:
        return cls(**raw)


@dataclass
class Segment:
    """Calls that extend one another, as one Episode-shaped record."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extended_by(self, call: CallRecord) -> bool:
        """Whether ``call``'s prompt is this segment's tokens plus new ones."""
        context = self.context
        return len(call.prompt_ids) >= len(context) and call.prompt_ids[: len(context)] == context

    def add(self, call: CallRecord) -> None:
        """Append the call: its new prompt tokens (mask 0), then its sampled ones (mask 1)."""
        new = call.prompt_ids[len(self.context) :] if self.num_turns else []
        self._extend(new, [0] * len(new), [0.0] * len(new), [NO_VERSION] * len(new))
        n = len(call.token_ids)
        self._extend(call.token_ids, [1] * n, call.logprobs, call.versions)
        self.num_turns += 1
        self.tool_calls += call.tool_calls
        self.tool_errors += call.tool_errors
        if call.message:
            self.messages.append(call.message)

    def _extend(self, ids: list[int], mask: list[int], logprobs: list[float],
                versions: list[int]) -> None:  # fmt: skip
        self.response_ids += ids
        self.response_mask += mask
        self.response_logprobs += logprobs
        self.response_versions += versions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def segments_of(calls: list[CallRecord]) -> list[Segment]:
    """The calls in order, grouped into segments (one when the session is token-native)."""
    segments: list[Segment] = []
    for call in calls:
        if not segments or not segments[-1].extended_by(call):
            segments.append(Segment(list(call.prompt_ids)))
        segments[-1].add(call)
    return segments


def session_episode(session_id: str, calls: list[CallRecord], reward: float | None) -> dict:
    """``/rl/end_session``'s answer: the segments and whether the session was token-native."""
    segments = segments_of(calls)
    return {"session_id": session_id, "reward": reward, "num_calls": len(calls),
            "generate_s": sum(call.generate_s for call in calls),
            "token_native": len(segments) <= 1, "num_segments": len(segments),
            "segments": [segment.to_dict() for segment in segments]}  # fmt: skip
