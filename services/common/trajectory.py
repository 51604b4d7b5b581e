"""The token-native record of one trained sequence, shared by every role that makes or trains one.

Why here, below the roles: the env role's loop, the router's agent gateway and the trainer
all speak this record (verl's ``AgentLoopOutput`` token fields), so it has one owner and one
codec, as the protos' messages do. ``prompt_ids`` is what the policy was first given;
``response_ids`` holds the tokens the policy sampled and, between them, the tokens the chat
template and the environment added; ``response_mask`` tells them apart (1 = sampled, trained;
0 = added, not trained). A position that was not sampled carries log-prob 0.0 and version
``NO_VERSION``, so the four response arrays line up one to one.

It grows by two appends only: ``extend_sampled`` (the policy's tokens, with their behaviour
log-probs and the weight version that sampled each) and ``extend_environment`` (everything
else). ``add_call`` is one generation call on top: the call's new prompt tokens (what was
added since this record's end) and its sampled ones; ``extended_by`` says whether a call's
prompt starts with this record's tokens, which is how calls that form one token-native
sequence merge into one record.

Its packed form (``arrays``/``from_arrays``, inside ``rlfleet.common.packed``'s frame) is the
one the episode's Redis and gRPC bytes use; ``to_dict``/``from_dict`` its JSON form (the
gateway's ``/rl/end_session`` answer), checked on the way in (``validate``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

NO_VERSION = -1
TOKEN_MAX = (1 << 31) - 1
ARRAYS = (
    ("response_ids", "i"),
    ("response_mask", "B"),
    ("response_logprobs", "f"),
    ("response_versions", "q"),
)
"""The response arrays and their packed type codes (int32, uint8, float32, int64)."""


class TrajectoryError(ValueError):
    """A record whose fields do not fit together (or bytes that are not one)."""


def token_versions(per_token: Sequence[int], n_tokens: int, default: int) -> list[int]:
    """Each of ``n_tokens`` tokens' weight version: ``per_token`` when it has one per token,
    else ``default`` (the row's version) for each, as from an engine that reports none."""
    if len(per_token) == n_tokens:
        return list(per_token)
    return [default] * n_tokens


@dataclass
class Trajectory:
    """Prompt ids, then the response arrays (see the module doc)."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    response_versions: list[int] = field(default_factory=list)

    def extend_sampled(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append tokens the policy sampled (trained)."""
        if not len(ids) == len(logprobs) == len(versions):
            raise TrajectoryError("sampled ids, log-probs and versions differ in length")
        self._extend(ids, [1] * len(ids), logprobs, versions)

    def extend_environment(self, ids: list[int]) -> None:
        """Append tokens the template or the environment added (never trained)."""
        n = len(ids)
        self._extend(ids, [0] * n, [0.0] * n, [NO_VERSION] * n)

    def _extend(
        self, ids: list[int], mask: list[int], logprobs: list[float], versions: list[int]
    ) -> None:
        self.response_ids.extend(ids)
        self.response_mask.extend(mask)
        self.response_logprobs.extend(logprobs)
        self.response_versions.extend(versions)

    @property
    def context(self) -> list[int]:
        """Every token so far: what a call that continues this record starts with."""
        return self.prompt_ids + self.response_ids

    def extended_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether ``prompt_ids`` is this record's tokens, then possibly more."""
        n = len(self.prompt_ids) + len(self.response_ids)
        return len(prompt_ids) >= n and list(prompt_ids[:n]) == self.context

    def add_call(
        self,
        prompt_ids: Sequence[int],
        sampled: list[int],
        logprobs: list[float],
        versions: list[int],
    ) -> None:
        """One generation on top of this record (``extended_by(prompt_ids)`` must hold): the
        prompt's tokens past the record's end (mask 0), then the sampled ones (mask 1)."""
        if not self.extended_by(prompt_ids):
            raise TrajectoryError("the call's prompt does not extend this record")
        self.extend_environment(list(prompt_ids[len(self.context) :]))
        self.extend_sampled(sampled, logprobs, versions)

    @classmethod
    def of_call(
        cls,
        prompt_ids: Sequence[int],
        sampled: list[int],
        logprobs: list[float],
        versions: list[int],
    ) -> Trajectory:
        """A record of one generation: its prompt, then what it sampled."""
        record = cls(list(prompt_ids))
        record.extend_sampled(sampled, logprobs, versions)
        return record

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.response_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among sampled tokens (a record is as stale as its oldest
        token); ``NO_VERSION`` when nothing was sampled."""
        sampled = [v for v, m in zip(self.response_versions, self.response_mask, strict=True) if m]
        return min(sampled, default=NO_VERSION)

    def sampled_ids(self) -> list[int]:
        """The trained tokens: ``response_ids`` where the mask is 1, in order."""
        return [t for t, m in zip(self.response_ids, self.response_mask, strict=True) if m]

    def tokens(self) -> Trajectory:
        """This record's token fields alone (a subclass's metadata left behind)."""
        return Trajectory(
            self.prompt_ids,
            self.response_ids,
            self.response_mask,
            self.response_logprobs,
            self.response_versions,
        )

    def validate(self) -> None:
        """Raise TrajectoryError naming the first field that does not fit."""
        _check_tokens("prompt_ids", self.prompt_ids)
        _check_tokens("response_ids", self.response_ids)
        n = len(self.response_ids)
        for name, _ in ARRAYS[1:]:
            if not isinstance(getattr(self, name), list) or len(getattr(self, name)) != n:
                raise TrajectoryError(f"{name} must be a list as long as response_ids ({n})")
        rows = zip(self.response_mask, self.response_logprobs, self.response_versions, strict=True)
        for i, (mask, logprob, version) in enumerate(rows):
            _check_position(i, mask, logprob, version)

    def lengths(self) -> list[int]:
        """``[len(prompt_ids), len(response_ids)]``: what a packed header says of the arrays."""
        return [len(self.prompt_ids), len(self.response_ids)]

    def arrays(self) -> list[tuple[str, list]]:
        """The packed arrays, in order: prompt ids, then ``ARRAYS``."""
        return [("i", self.prompt_ids), *((code, getattr(self, name)) for name, code in ARRAYS)]

    @staticmethod
    def layout(lengths: Sequence[int]) -> list[tuple[str, int]]:
        """``read_arrays``' layout of the record ``lengths`` (``lengths()``) describes."""
        n_prompt, n = _counts(lengths)
        return [("i", n_prompt), *((code, n) for _, code in ARRAYS)]

    @classmethod
    def from_arrays(cls, arrays: Sequence[list]) -> Trajectory:
        """The record of ``arrays``' five lists (``arrays()``' order), validated."""
        record = cls(*[list(values) for values in arrays])
        record.validate()
        return record

    def to_dict(self) -> dict[str, list]:
        return asdict(self.tokens())

    @classmethod
    def from_dict(cls, raw: object) -> Trajectory:
        """The record of ``to_dict``'s form, validated; TrajectoryError for anything else."""
        names = ["prompt_ids", *(name for name, _ in ARRAYS)]
        if not isinstance(raw, dict) or sorted(raw) != sorted(names):
            raise TrajectoryError(f"a trajectory is an object with exactly {names}")
        record = cls(**{name: raw[name] for name in names})
        record.validate()
        return record


def _counts(lengths: Sequence[int]) -> tuple[int, int]:
    if len(lengths) != 2 or not all(_is_count(n) for n in lengths):
        raise TrajectoryError(f"array lengths must be two non-negative integers, got {lengths!r}")
    return lengths[0], lengths[1]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tokens(name: str, ids: object) -> None:
    if not isinstance(ids, list):
        raise TrajectoryError(f"{name} must be a list of token ids")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= TOKEN_MAX:
            raise TrajectoryError(f"{name} holds {token!r}, not a token id")


def _check_position(i: int, mask: object, logprob: object, version: object) -> None:
    if mask not in (0, 1) or isinstance(mask, bool):
        raise TrajectoryError(f"response_mask[{i}] must be 0 or 1, got {mask!r}")
    if not is_number(logprob):
        raise TrajectoryError(f"response_logprobs[{i}] must be a finite log-prob, got {logprob!r}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TrajectoryError(f"response_versions[{i}] must be an integer, got {version!r}")
    if mask == 0 and (logprob != 0.0 or version != NO_VERSION):
        raise TrajectoryError(f"position {i} is not sampled: log-prob must be 0.0, version -1")
    if mask == 1 and version < 0:
        raise TrajectoryError(f"response_versions[{i}] of a sampled token must be >= 0")


def is_number(value: object) -> bool:
    """A finite int or float (a bool is not a number here)."""
    real = isinstance(value, int | float) and not isinstance(value, bool)
    return real and math.isfinite(value)  # type: ignore[arg-type]
