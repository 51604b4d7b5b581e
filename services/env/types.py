"""Plain objects of the env role, shared by its front door, its workers and its client.

An episode job travels through Redis as JSON (``encode_job``: the job and the batch's
settings, so a worker needs nothing else); its answer as ``EpisodeOutcome.encode()``:
``rlfleet.common.packed``'s frame with a small header (episode id, error, restarts, replicas)
and, as its body, the episode's own bytes (``Episode.encode()``), which the front door passes
through untouched. Neither side needs protobuf; ``convert`` maps these to and from the proto.

Validation (``validate_request``) is the one place a batch is checked, by the client before
sending and by the service on arrival, so both refuse a bad value the same way: an
``InvalidArgument`` whose message starts with the field (``jobs[3].episode_id ...``).
``max_turns`` and ``max_episode_tokens`` 0 mean "the service's ``agent`` config"
(``EpisodeSettings.resolved``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from rlfleet.agent.episode import EndReason, Episode
from rlfleet.common.errors import InvalidArgument
from rlfleet.common.packed import pack, unpack
from rlfleet.rollout.types import SamplingParams

MAX_ID_CHARS = 256
MAX_JOBS = 65_536
MAX_TASK_BYTES = 1 << 20
MAX_TURNS = 1024
MAX_EPISODE_TOKENS = 1 << 20
INT64_MAX = (1 << 63) - 1
OUTCOME_MAGIC = b"\x00EO1"  # never the first bytes of JSON


@dataclass
class EpisodeJob:
    """One episode to play: ``task`` is the dataset row handed to the environment's ``reset``."""

    episode_id: str
    task: dict[str, Any] = field(default_factory=dict)
    group_id: str = ""
    min_weight_version: int = 0

    @classmethod
    def from_dict(cls, raw: Any) -> EpisodeJob:
        if not isinstance(raw, dict):
            raise TypeError(f"an episode job is an EpisodeJob or a dict, got {type(raw).__name__}")
        unknown = set(raw) - {"episode_id", "task", "group_id", "min_weight_version"}
        if unknown:
            raise InvalidArgument(f"unknown EpisodeJob fields: {sorted(unknown)}")
        if "episode_id" not in raw:
            raise InvalidArgument("EpisodeJob needs an episode_id")
        return cls(**raw)


@dataclass(frozen=True)
class EpisodeSettings:
    """What every episode of one batch shares: per-turn sampling and the episode limits."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_turns: int = 0
    max_episode_tokens: int = 0

    def resolved(self, max_turns: int, max_episode_tokens: int) -> EpisodeSettings:
        """0 limits replaced by the service's own (``agent.max_turns``, ...)."""
        return replace(
            self,
            max_turns=self.max_turns or max_turns,
            max_episode_tokens=self.max_episode_tokens or max_episode_tokens,
        )


@dataclass
class EpisodeOutcome:
    """A worker's answer for one episode (``episode``: ``Episode.encode()`` bytes)."""

    episode_id: str
    episode: bytes
    error: str = ""
    restarts: int = 0
    replica_ids: list[str] = field(default_factory=list)

    @classmethod
    def failed(cls, episode_id: str, error: str, restarts: int = 0) -> EpisodeOutcome:
        """An episode that could not be played: an error episode, so every answer has one."""
        return cls(episode_id, failed_episode(episode_id, error).encode(), error, restarts)

    def encode(self) -> bytes:
        """The packed frame: the scalars as its header, the episode's bytes as its body."""
        head = {
            "episode_id": self.episode_id,
            "error": self.error,
            "restarts": self.restarts,
            "replica_ids": self.replica_ids,
        }
        return pack(OUTCOME_MAGIC, head, []) + self.episode

    @classmethod
    def decode(cls, data: bytes) -> EpisodeOutcome:
        """The outcome ``encode`` wrote; InvalidArgument for anything else."""
        try:
            head, body = unpack(OUTCOME_MAGIC, data)
            return cls(**head, episode=bytes(body))
        except (ValueError, TypeError) as exc:  # PackedError is a ValueError
            raise InvalidArgument(f"not an episode outcome: {exc}") from exc


@dataclass
class EpisodeResult:
    """What a client gets for one episode: the decoded Episode (an error episode on failure)."""

    episode_id: str
    episode: Episode
    error: str = ""
    restarts: int = 0
    replica_ids: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.error) or self.episode.failed


@dataclass(frozen=True)
class EnvironmentInfo:
    """What ``ListEnvironments`` reports about one environment."""

    name: str
    kind: str  # "builtin" | "import"
    active: bool


@dataclass(frozen=True)
class QueuedEpisode:
    """One queue entry: the job and its batch's settings (resolved)."""

    job: EpisodeJob
    settings: EpisodeSettings


def failed_episode(episode_id: str, error: str) -> Episode:
    """An episode that ended before its first turn (or was lost): no tokens, ``error`` set."""
    return Episode(episode_id=episode_id, prompt_ids=[], end_reason=EndReason.ERROR, error=error)


def encode_job(job: EpisodeJob, settings: EpisodeSettings) -> bytes:
    raw = {
        "job": asdict(job),
        "sampling": asdict(settings.sampling),
        "max_turns": settings.max_turns,
        "max_episode_tokens": settings.max_episode_tokens,
    }
    return json.dumps(raw).encode()


def decode_job(data: bytes) -> QueuedEpisode:
    """The entry ``encode_job`` wrote, validated again; InvalidArgument for anything else."""
    try:
        raw = json.loads(data)
        job = EpisodeJob.from_dict(raw["job"])
        settings = EpisodeSettings(
            SamplingParams(**raw["sampling"]), raw["max_turns"], raw["max_episode_tokens"]
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidArgument(f"not an episode job: {exc}") from exc
    validate_request([job], settings)
    return QueuedEpisode(job, settings)


def validate_request(jobs: list[EpisodeJob], settings: EpisodeSettings) -> None:
    """Raise InvalidArgument naming the first field that no worker could honour."""
    if len(jobs) > MAX_JOBS:
        raise InvalidArgument(f"jobs: {len(jobs)} is more than {MAX_JOBS} episodes in one call")
    validate_settings(settings)
    seen: set[str] = set()
    for index, job in enumerate(jobs):
        validate_job(job, f"jobs[{index}]")
        if job.episode_id in seen:
            raise InvalidArgument(f"jobs[{index}].episode_id {job.episode_id!r} is a duplicate")
        seen.add(job.episode_id)


def validate_settings(settings: EpisodeSettings) -> None:
    if not isinstance(settings.sampling, SamplingParams):
        raise InvalidArgument("sampling must be SamplingParams")
    settings.sampling.validate()
    if settings.sampling.n != 1:
        raise InvalidArgument("sampling.n must be 1: a group is several jobs with one group_id")
    _check_int("max_turns", settings.max_turns, MAX_TURNS)
    _check_int("max_episode_tokens", settings.max_episode_tokens, MAX_EPISODE_TOKENS)


def validate_job(job: EpisodeJob, where: str) -> None:
    if not isinstance(job, EpisodeJob):
        raise InvalidArgument(f"{where} must be an EpisodeJob, got {type(job).__name__}")
    _check_id(f"{where}.episode_id", job.episode_id, 1)
    _check_id(f"{where}.group_id", job.group_id, 0)
    _check_int(f"{where}.min_weight_version", job.min_weight_version, INT64_MAX)
    if not isinstance(job.task, dict) or not all(isinstance(k, str) for k in job.task):
        raise InvalidArgument(f"{where}.task must be an object (a dict with string keys)")
    _check_task_size(f"{where}.task", job.task)


def _check_id(name: str, value: object, min_chars: int) -> None:
    if not (isinstance(value, str) and min_chars <= len(value) <= MAX_ID_CHARS) or "\n" in value:
        raise InvalidArgument(
            f"{name} must be a string of {min_chars}-{MAX_ID_CHARS} "
            f"characters on one line, got {value!r:.80}"
        )


def _check_int(name: str, value: object, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise InvalidArgument(f"{name} must be an integer in [0, {high}], got {value!r}")


def _check_task_size(name: str, task: dict[str, Any]) -> None:
    try:
        size = len(json.dumps(task, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{name} is not JSON: {exc}") from exc
    if size > MAX_TASK_BYTES:
        raise InvalidArgument(f"{name} is {size} bytes of JSON (limit {MAX_TASK_BYTES})")
