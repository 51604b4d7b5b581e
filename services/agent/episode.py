"""One multi-turn episode as the trainer needs it: token-native records plus what happened.

Why a record on top of ``Trajectory`` (``rlfleet.common.trajectory``, the token fields every
role shares): an episode adds what the trainer and the metrics read about the whole play (the
reward and its parts, turns, tool calls, why it ended, timings, the transcript). Its own token
fields are its main line: the whole episode when the loop played it, or a gateway session's
last branch, the conversation that reached the reward. ``earlier`` holds the session's other
branches (calls whose prompts did not extend the record before them: the agent rewrote its
history, a completion cut by ``max_tokens`` was re-rendered differently, ...), each a trained
record of its own with the same reward (``branches``); ``agent.multi_call`` decides how a
session's calls become branches (``rlfleet.common.config``).

``encode`` is the Redis and gRPC form, in ``rlfleet.common.packed``'s frame: the magic
``\\0AE2``, a JSON header (scalars, reward parts, transcript, each branch's array lengths),
then every branch's arrays, main line last. ``decode`` checks everything it reads
(``EpisodeError``), so a corrupt or foreign entry never reaches the trainer as a half-valid
episode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.packed import PackedError, pack, read_arrays, unpack
from rlfleet.common.trajectory import Trajectory, TrajectoryError, is_number

MAGIC = b"\x00AE2"  # never the first bytes of JSON
_SCALARS = {
    "episode_id": str,
    "reward": float,
    "num_turns": int,
    "tool_calls": int,
    "tool_errors": int,
    "error": str,
    "generate_s": float,
    "env_s": float,
}

EpisodeError = TrajectoryError
"""An episode whose fields do not fit together (or bytes that are not an episode)."""


class EndReason(enum.StrEnum):
    """Why an episode ended; travels as its string value."""

    DONE = "done"  # the environment said so
    MAX_TURNS = "max_turns"  # agent.max_turns assistant turns without the environment ending
    TOKEN_BUDGET = "token_budget"  # prompt + response reached agent.max_episode_tokens
    ERROR = "error"  # the environment failed (raised, bad output): a counted failed episode


@dataclass(kw_only=True)
class Episode(Trajectory):
    """The record of one episode; ``extend_*`` grow its main line turn by turn."""

    episode_id: str
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    num_turns: int = 0
    """Generation calls the policy answered in this episode (every branch's)."""
    tool_calls: int = 0
    tool_errors: int = 0
    end_reason: EndReason = EndReason.DONE
    error: str = ""
    generate_s: float = 0.0
    env_s: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)
    earlier: list[Trajectory] = field(default_factory=list)
    """The branches before the main line, in call order (a gateway session's calls that did
    not form one token-native sequence); empty for an episode the loop played."""

    def branches(self) -> list[Trajectory]:
        """Every trained record of the episode, in call order: ``earlier``, then the main line."""
        return [*self.earlier, self.tokens()]

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled in the whole episode (every branch)."""
        return sum(branch.num_sampled for branch in self.branches())

    @property
    def truncated(self) -> bool:
        return self.end_reason == EndReason.TOKEN_BUDGET

    @property
    def failed(self) -> bool:
        return self.end_reason == EndReason.ERROR

    def validate(self) -> None:
        """Raise EpisodeError naming the first field that does not fit."""
        _check_scalars(self)
        if not isinstance(self.end_reason, EndReason):
            raise EpisodeError(f"end_reason must be an EndReason, got {self.end_reason!r}")
        if not isinstance(self.earlier, list) or not all(
            isinstance(b, Trajectory) for b in self.earlier
        ):
            raise EpisodeError("earlier must be a list of Trajectory records")
        for branch in self.branches():
            Trajectory.validate(branch)
        _check_parts(self.reward_parts)
        if not isinstance(self.messages, list) or not all(
            isinstance(m, dict) for m in self.messages
        ):
            raise EpisodeError("messages must be a list of message objects")

    def encode(self) -> bytes:
        """The packed form (see the module doc)."""
        self.validate()
        branches = self.branches()
        head = {name: getattr(self, name) for name in _SCALARS}
        head.update(
            end_reason=str(self.end_reason),
            reward_parts=self.reward_parts,
            messages=self.messages,
            branches=[b.lengths() for b in branches],
        )
        return pack(MAGIC, head, [array for b in branches for array in b.arrays()])

    @classmethod
    def decode(cls, data: bytes) -> Episode:
        """The episode ``encode`` wrote; EpisodeError for anything else."""
        try:
            head, body = unpack(MAGIC, data)
            lengths = _branch_lengths(head)
            arrays = read_arrays(body, [a for n in lengths for a in Trajectory.layout(n)])
        except PackedError as exc:
            raise EpisodeError(f"not an encoded episode: {exc}") from exc
        branches = [Trajectory(*arrays[i : i + 5]) for i in range(0, len(arrays), 5)]
        main = branches.pop()
        fields: dict[str, Any] = {name: head.get(name) for name in _SCALARS}
        episode = cls(
            **fields,
            **vars(main),
            earlier=branches,
            reward_parts=head.get("reward_parts"),
            end_reason=_end_reason(head.get("end_reason")),
            messages=head.get("messages"),
        )
        episode.validate()
        return episode


def _branch_lengths(head: object) -> list[list[int]]:
    lengths = head.get("branches") if isinstance(head, dict) else None
    if not isinstance(lengths, list) or not lengths:
        raise EpisodeError("episode header must be an object listing at least one branch")
    for n in lengths:
        Trajectory.layout(n)  # refuses anything but two non-negative counts
    return lengths


def _end_reason(value: object) -> EndReason:
    try:
        return EndReason(str(value))
    except ValueError as exc:
        raise EpisodeError(f"unknown end_reason {value!r}") from exc


def _check_scalars(episode: Episode) -> None:
    for name, kind in _SCALARS.items():
        value = getattr(episode, name)
        ok = is_number(value) if kind is float else isinstance(value, kind)
        if isinstance(value, bool) or not ok:
            raise EpisodeError(f"{name} must be a finite {kind.__name__}, got {value!r}")
        if kind is int and value < 0:
            raise EpisodeError(f"{name} must not be negative, got {value!r}")
    if not episode.episode_id:
        raise EpisodeError("episode_id must not be empty")


def _check_parts(parts: object) -> None:
    if not isinstance(parts, dict):
        raise EpisodeError("reward_parts must be a mapping of name to number")
    for name, value in parts.items():
        if not isinstance(name, str) or not is_number(value):
            raise EpisodeError(f"reward_parts[{name!r}] must be a finite number, got {value!r}")
