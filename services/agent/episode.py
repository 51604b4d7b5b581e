"""One multi-turn episode as the trainer needs it: token-native, shaped like verl's AgentLoopOutput.

Why token-native: the trainer must score exactly the tokens the policy sampled, with their
behaviour log-probs and weight versions. ``response_ids`` holds the policy's tokens and, between
turns, the tokens the chat template and the environment added; ``response_mask`` tells them
apart (1 = sampled, trained; 0 = observation or template, not trained). Masked-out positions
carry log-prob 0.0 and version -1, so the arrays line up one to one.

``encode`` is the Redis form: a magic, a JSON header (scalars, reward parts, transcript) and
the arrays packed little-endian (int32 ids, uint8 mask, float32 log-probs, int64 versions),
because an episode holds thousands of numbers that JSON would print one by one. ``decode``
checks everything it reads (``EpisodeError``), so a corrupt or foreign entry never reaches the
trainer as a half-valid episode.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"\x00AE1"  # never the first bytes of JSON
HEADER_LEN = struct.Struct("<I")
TOKEN_MAX = (1 << 31) - 1
NO_VERSION = -1
_ARRAYS = (("response_ids", "i", 4), ("response_mask", "B", 1),
           ("response_logprobs", "f", 4), ("response_versions", "q", 8))  # fmt: skip
_SCALARS = {"episode_id": str, "reward": float, "num_turns": int, "tool_calls": int,
            "tool_errors": int, "error": str, "generate_s": float, "env_s": float}  # fmt: skip


class EndReason(enum.StrEnum):
    """Why an episode ended; travels as its string value."""

    DONE = "done"  # the environment said so
    MAX_TURNS = "max_turns"  # agent.max_turns assistant turns without the environment ending
    TOKEN_BUDGET = "token_budget"  # prompt + response reached agent.max_episode_tokens
    ERROR = "error"  # the environment failed (raised, bad output): a counted failed episode


class EpisodeError(ValueError):
    """An episode whose fields do not fit together (or bytes that are not an episode)."""


@dataclass
class Episode:
    """The record of one episode; ``extend_*`` grow it turn by turn."""

    episode_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end_reason: EndReason = EndReason.DONE
    error: str = ""
    generate_s: float = 0.0
    env_s: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)

    def extend_sampled(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append tokens the policy sampled (trained)."""
        if not len(ids) == len(logprobs) == len(versions):
            raise EpisodeError("sampled ids, log-probs and versions differ in length")
        self.response_ids.extend(ids)
        self.response_mask.extend([1] * len(ids))
        self.response_logprobs.extend(logprobs)
        self.response_versions.extend(versions)

    def extend_environment(self, ids: list[int]) -> None:
        """Append tokens the template or the environment added (never trained)."""
        self.response_ids.extend(ids)
        self.response_mask.extend([0] * len(ids))
        self.response_logprobs.extend([0.0] * len(ids))
        self.response_versions.extend([NO_VERSION] * len(ids))

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.response_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among sampled tokens (the episode's staleness is that of
        its oldest token); -1 when nothing was sampled."""
        sampled = [v for v, m in zip(self.response_versions, self.response_mask, strict=True) if m]
        return min(sampled, default=NO_VERSION)

    @property
    def truncated(self) -> bool:
        return self.end_reason == EndReason.TOKEN_BUDGET

    @property
    def failed(self) -> bool:
        return self.end_reason == EndReason.ERROR

    def sampled_ids(self) -> list[int]:
        """The trained tokens: ``response_ids`` where the mask is 1, in order."""
        return [t for t, m in zip(self.response_ids, self.response_mask, strict=True) if m]

    def validate(self) -> None:
        """Raise EpisodeError naming the first field that does not fit."""
        _check_scalars(self)
        if not isinstance(self.end_reason, EndReason):
            raise EpisodeError(f"end_reason must be an EndReason, got {self.end_reason!r}")
        _check_tokens("prompt_ids", self.prompt_ids)
        _check_tokens("response_ids", self.response_ids)
        _check_response_arrays(self)
        _check_parts(self.reward_parts)
        if not isinstance(self.messages, list) or not all(
            isinstance(m, dict) for m in self.messages
        ):
            raise EpisodeError("messages must be a list of message objects")  # fmt: skip

    def encode(self) -> bytes:
        """Magic, header length, JSON header, then the packed arrays (see the module doc)."""
        self.validate()
        head = {name: getattr(self, name) for name in _SCALARS}
        head.update(end_reason=str(self.end_reason), reward_parts=self.reward_parts,
                    messages=self.messages, n_prompt=len(self.prompt_ids),
                    n_response=len(self.response_ids))  # fmt: skip
        header = json.dumps(head, default=str).encode()
        n = len(self.response_ids)
        arrays = [struct.pack(f"<{len(self.prompt_ids)}i", *self.prompt_ids)]
        arrays += [struct.pack(f"<{n}{code}", *getattr(self, name)) for name, code, _ in _ARRAYS]
        return b"".join([MAGIC, HEADER_LEN.pack(len(header)), header, *arrays])

    @classmethod
    def decode(cls, data: bytes) -> Episode:
        """The episode ``encode`` wrote; EpisodeError for anything else."""
        head, body = _split(data)
        n_prompt, n = _count(head, "n_prompt"), _count(head, "n_response")
        sizes = [4 * n_prompt] + [width * n for _, _, width in _ARRAYS]
        if len(body) != sum(sizes):
            raise EpisodeError(f"episode body is {len(body)} bytes, header says {sum(sizes)}")
        fields: dict[str, Any] = {name: head.get(name) for name in _SCALARS}
        fields["prompt_ids"] = list(struct.unpack_from(f"<{n_prompt}i", body))
        offset = sizes[0]
        for (name, code, _), size in zip(_ARRAYS, sizes[1:], strict=True):
            fields[name] = list(struct.unpack_from(f"<{n}{code}", body, offset))
            offset += size
        episode = cls(**fields, reward_parts=head.get("reward_parts"),
                      end_reason=_end_reason(head.get("end_reason")),
                      messages=head.get("messages"))  # fmt: skip
        episode.validate()
        return episode


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    if not isinstance(data, bytes | bytearray | memoryview) or not bytes(data[:4]) == MAGIC:
        raise EpisodeError("not an encoded episode (bad magic)")
    start = len(MAGIC) + HEADER_LEN.size
    if len(data) < start:
        raise EpisodeError("episode too short for its header")
    (size,) = HEADER_LEN.unpack_from(data, len(MAGIC))
    try:
        head = json.loads(bytes(data[start : start + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EpisodeError(f"episode header is not JSON: {exc}") from exc
    if not isinstance(head, dict):
        raise EpisodeError("episode header must be a JSON object")
    return head, bytes(data[start + size :])


def _count(head: dict[str, Any], name: str) -> int:
    value = head.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EpisodeError(f"header field {name} must be a non-negative integer, got {value!r}")
    return value


def _end_reason(value: object) -> EndReason:
    try:
        return EndReason(value)
    except ValueError as exc:
        raise EpisodeError(f"unknown end_reason {value!r}") from exc


def _check_scalars(episode: Episode) -> None:
    for name, kind in _SCALARS.items():
        value = getattr(episode, name)
        ok = _is_number(value) if kind is float else isinstance(value, kind)
        if isinstance(value, bool) or not ok:
            raise EpisodeError(f"{name} must be a finite {kind.__name__}, got {value!r}")
        if kind is int and value < 0:
            raise EpisodeError(f"{name} must not be negative, got {value!r}")
    if not episode.episode_id:
        raise EpisodeError("episode_id must not be empty")


def _check_tokens(name: str, ids: object) -> None:
    if not isinstance(ids, list):
        raise EpisodeError(f"{name} must be a list of token ids")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= TOKEN_MAX:
            raise EpisodeError(f"{name} holds {token!r}, not a token id")


def _check_response_arrays(episode: Episode) -> None:
    n = len(episode.response_ids)
    for name, _, _ in _ARRAYS[1:]:
        if not isinstance(getattr(episode, name), list) or len(getattr(episode, name)) != n:
            raise EpisodeError(f"{name} must be a list as long as response_ids ({n})")
    rows = zip(episode.response_mask, episode.response_logprobs, episode.response_versions,
               strict=True)  # fmt: skip
    for i, (mask, logprob, version) in enumerate(rows):
        _check_position(i, mask, logprob, version)


def _check_position(i: int, mask: object, logprob: object, version: object) -> None:
    if mask not in (0, 1) or isinstance(mask, bool):
        raise EpisodeError(f"response_mask[{i}] must be 0 or 1, got {mask!r}")
    if not _is_number(logprob):
        raise EpisodeError(f"response_logprobs[{i}] must be a finite log-prob, got {logprob!r}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise EpisodeError(f"response_versions[{i}] must be an integer, got {version!r}")
    if mask == 0 and (logprob != 0.0 or version != NO_VERSION):
        raise EpisodeError(f"position {i} is not sampled: log-prob must be 0.0, version -1")
    if mask == 1 and version < 0:
        raise EpisodeError(f"response_versions[{i}] of a sampled token must be >= 0")


def _check_parts(parts: object) -> None:
    if not isinstance(parts, dict):
        raise EpisodeError("reward_parts must be a mapping of name to number")
    for name, value in parts.items():
        if not isinstance(name, str) or not _is_number(value):
            raise EpisodeError(f"reward_parts[{name!r}] must be a finite number, got {value!r}")


def _is_number(value: object) -> bool:
    """A finite int or float (a bool is not a number here)."""
    real = isinstance(value, int | float) and not isinstance(value, bool)
    return real and math.isfinite(value)
