"""Plain objects for generation, shared by the router, the replicas and their clients.

They travel through Redis as JSON (``to_json``/``from_json``), so neither the router's
nor the replica's core needs protobuf; ``server.py`` files convert to and from proto.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field

from rlfleet.common.errors import InvalidArgument

MAX_SAMPLES = 1024
MAX_NEW_TOKENS = 1 << 16


class ReplicaState(enum.StrEnum):
    """Where a replica is in its life; travels as its string value (Redis, protos)."""

    STARTING = "starting"  # registered, engine still loading
    SERVING = "serving"  # takes new work
    PAUSED = "paused"  # finishes in-flight work, takes none
    UPDATING = "updating"  # loading new weights
    DRAINING = "draining"  # shutting down, or marked by a router: no new work
    DEAD = "dead"  # heartbeat expired (as the router reports it)
    UNKNOWN = "unknown"  # an entry without (or with an unreadable) state

    @classmethod
    def parse(cls, text: str) -> ReplicaState:
        """The state a string names; UNKNOWN for anything else (a newer peer's state)."""
        try:
            return cls(text)
        except ValueError:
            return cls.UNKNOWN


@dataclass
class ReplicaStatus:
    """One replica as reported by itself (GetStatus) or by a router (ListReplicas)."""

    replica_id: str
    address: str
    weight_version: int
    state: ReplicaState
    in_flight: int
    backend: str
    served: int
    heartbeat_age_s: float


@dataclass
class UpdateOutcome:
    """A replica's answer to a weight update: the version it now serves."""

    version: int
    load_seconds: float
    cache_flushed: bool


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: int = 1

    def validate(self) -> None:
        """Raise InvalidArgument for values no engine can honour."""
        if not 1 <= self.n <= MAX_SAMPLES:
            raise InvalidArgument(f"sampling.n must be in [1, {MAX_SAMPLES}], got {self.n}")
        if not 1 <= self.max_tokens <= MAX_NEW_TOKENS:
            raise InvalidArgument(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidArgument(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs not in (0, 1):
            raise InvalidArgument("sampling.logprobs must be 0 or 1 (the sampled token's)")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class GenerateRequest:
    request_id: str
    sampling: SamplingParams
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    session_id: str = ""
    min_weight_version: int = 0
    timeout_s: float = 0.0

    def validate(self) -> None:
        if not self.request_id or len(self.request_id) > 256:
            raise InvalidArgument("request_id must be 1-256 characters")
        if not self.prompt_token_ids and not self.prompt_text:
            raise InvalidArgument("a prompt (text or token ids) is required")
        if self.prompt_token_ids and any(t < 0 for t in self.prompt_token_ids):
            raise InvalidArgument("prompt token ids must be >= 0")
        if self.min_weight_version < 0 or self.timeout_s < 0:
            raise InvalidArgument("min_weight_version and timeout_s must be >= 0")
        self.sampling.validate()

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> GenerateRequest:
        raw = json.loads(data)
        raw["sampling"] = SamplingParams(**raw["sampling"])
        return cls(**raw)


@dataclass
class GenerateResult:
    request_id: str
    completions: list[Completion]
    weight_version: int
    replica_id: str
    prompt_token_ids: list[int] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> GenerateResult:
        raw = json.loads(data)
        raw["completions"] = [Completion(**c) for c in raw["completions"]]
        return cls(**raw)
