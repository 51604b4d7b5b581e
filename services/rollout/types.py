"""Plain objects for generation, shared by the router, the replicas and their clients.

They travel through Redis without protobuf, so neither the router's nor the replica's core
needs it; ``server.py`` files convert to and from proto. A request travels as JSON (small); a
batch member's result as ``GenerateResult.encode()``: a JSON header plus the token ids,
log-probs and versions as packed int32/float32/int64 arrays (``rlfleet.common.packed``, the
frame the episode travels in too), because a step's completions are thousands of numbers that
JSON would print and parse one by one (a single request's answer is still JSON, which every
reader of the queue understands; ``decode`` reads both). Several requests for one replica
travel as one queue entry
(``pack_requests``): a JSON object, so a janitor reads its ``min_weight_version`` like a single
request's.

Validation (``validate``) is the one place every front door (router and replica gRPC, the
router's HTTP API, queued JSON) checks a request, so each answers a bad value the same way:
``InvalidField`` (an ``InvalidArgument``, so INVALID_ARGUMENT / HTTP 400) naming the field.
NaN and infinite numbers are refused everywhere (a NaN timeout once made the router wait until
the caller's deadline). Proto3 cannot tell an unset scalar from 0, so ``convert`` applies one
rule: a request without ``sampling`` gets the defaults below; a request WITH ``sampling``
means every field in it, so ``n=0`` and ``max_tokens=0`` are refused, not replaced. The two
zeros the proto documents as "unset" keep that meaning: ``top_p`` 0 is 1 and ``top_k`` <= 0
is off. JSON (HTTP) can tell absent from 0: an absent field takes the default, an explicit
out-of-range value (``top_p: 0`` included) is refused.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from rlfleet.common import packed
from rlfleet.common.errors import InvalidArgument
from rlfleet.common.trajectory import token_versions
from rlfleet.model.weights_relay import RelayResult

MAX_SAMPLES = 1024
MAX_NEW_TOKENS = 1 << 16
MAX_ID_CHARS = 256
MAX_TIMEOUT_S = 86_400.0
MAX_STOP_STRINGS = 64
INT32_MAX = (1 << 31) - 1
INT64 = (-(1 << 63), (1 << 63) - 1)
PACKED_MAGIC = b"\x00RG1"  # never the first bytes of JSON, so old JSON answers still decode
BATCH_FIELD = "batch"


class ReplicaState(enum.StrEnum):
    """Where a replica is in its life; travels as its string value (Redis, protos)."""

    STARTING = "starting"  # registered, engine still loading
    SERVING = "serving"  # takes new work
    PAUSED = "paused"  # finishes in-flight work, takes none
    UPDATING = "updating"  # loading new weights
    UPDATE_FAILED = "update_failed"  # a weight load failed midway: no work until one succeeds
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
    """A replica's answer to a weight update: the version it now serves, and its times."""

    version: int
    load_seconds: float
    """The swap into the engine and the cache flush."""
    cache_flushed: bool
    pause_seconds: float = 0.0
    """How long admission was closed for it (monotonic clock): making way for the update
    (``rollout.update_policy``), the swap and the flush; the trainer's ``weight/pause_s``."""
    prepare_seconds: float = 0.0
    """Decoding, checking and staging it while the old weights served (receiving excluded)."""
    relayed: list[RelayResult] = field(default_factory=list)
    """Every replica below this one in the update's relay tree (``weights_relay``)."""


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
        """Raise InvalidField for values no engine can honour (see the module docstring)."""
        _check_int("sampling.n", self.n, 1, MAX_SAMPLES)
        _check_int("sampling.max_tokens", self.max_tokens, 1, MAX_NEW_TOKENS)
        _check_float("sampling.temperature", self.temperature, 0.0)
        _check_float("sampling.top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0:
            raise InvalidField("sampling.top_p", "must be in (0, 1], got 0")
        _check_int("sampling.top_k", self.top_k, 0, INT32_MAX)
        _check_stop(self.stop)
        if self.seed is not None:
            _check_int("sampling.seed", self.seed, *INT64)
        if self.logprobs not in (0, 1) or isinstance(self.logprobs, bool):
            raise InvalidField("sampling.logprobs", "must be 0 or 1 (the sampled token's)")


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token, one per token (packed like the log-probs).
    A request a weight update crossed (``rollout.update_policy: keep``) holds tokens of two or
    more versions; empty from a peer that does not report them (``versions`` fills it in)."""

    def versions(self, default: int) -> list[int]:
        """The version of every token: ``weight_versions``, or ``default`` (the result's
        ``weight_version``) for each token when the completion carries none."""
        return token_versions(self.weight_versions, len(self.token_ids), default)


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
        """Raise InvalidField naming the first bad field (see the module docstring)."""
        _check_text("request_id", self.request_id, 1)
        if "\n" in self.request_id:
            raise InvalidField("request_id", "must be a single line")
        _check_text("session_id", self.session_id, 0)
        _check_prompt(self.prompt_token_ids, self.prompt_text)
        _check_int("min_weight_version", self.min_weight_version, 0, INT64[1])
        _check_float("timeout_s", self.timeout_s, 0.0, MAX_TIMEOUT_S)
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidField("sampling", "must be sampling parameters")
        self.sampling.validate()

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    def fingerprint(self) -> str:
        """What the request id is bound to: the prompt and the sampling (sha256, hex). The
        same id with another fingerprint is another request, refused while the id is known."""
        content = [self.prompt_token_ids, self.prompt_text, asdict(self.sampling)]
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_json(cls, data: bytes) -> GenerateRequest:
        return _request_from_dict(json.loads(data))


@dataclass
class GenerateResult:
    """One request's answer. ``weight_version`` is the version the request started under, so
    the oldest of its tokens' (``Completion.weight_versions`` has each token's)."""

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

    def encode(self) -> bytes:
        """Packed (``rlfleet.common.packed``): the header, then int32 token ids (the prompt's,
        then each completion's), float32 log-probs and int64 per-token weight versions (the
        engine's log-probs are float32 already, so nothing is lost)."""
        cs = self.completions
        head = [
            self.request_id,
            self.weight_version,
            self.replica_id,
            len(self.prompt_token_ids),
            [
                [c.text, c.finish_reason, len(c.token_ids), len(c.logprobs), len(c.weight_versions)]
                for c in cs
            ],
        ]
        ids = self.prompt_token_ids + [t for c in cs for t in c.token_ids]
        return packed.pack(
            PACKED_MAGIC,
            head,
            [
                ("i", ids),
                ("f", [lp for c in cs for lp in c.logprobs]),
                ("q", [v for c in cs for v in c.weight_versions]),
            ],
        )

    @classmethod
    def decode(cls, data: bytes) -> GenerateResult:
        """From ``encode`` (or ``to_json``, what replicas wrote before packing). A header
        entry without a version count (written before per-token versions) has none."""
        if not packed.is_packed(PACKED_MAGIC, data):
            return cls.from_json(data)
        head, body = packed.unpack(PACKED_MAGIC, data)
        request_id, version, replica_id, n_prompt, heads = head
        heads = [[*h, 0][:5] for h in heads]
        n_ids = n_prompt + sum(h[2] for h in heads)
        ids, logprobs, versions = packed.read_arrays(
            body, [("i", n_ids), ("f", sum(h[3] for h in heads)), ("q", sum(h[4] for h in heads))]
        )
        completions, i, j, k = [], n_prompt, 0, 0
        for text, reason, n_tokens, n_logprobs, n_versions in heads:
            completions.append(
                Completion(
                    ids[i : i + n_tokens],
                    logprobs[j : j + n_logprobs],
                    text,
                    reason,
                    versions[k : k + n_versions],
                )
            )
            i, j, k = i + n_tokens, j + n_logprobs, k + n_versions
        return cls(request_id, completions, version, replica_id, ids[:n_prompt])


def pack_requests(requests: Sequence[GenerateRequest]) -> bytes:
    """Several requests as one queue entry (one replica's share of a batch)."""
    newest = max((r.min_weight_version for r in requests), default=0)
    members = [asdict(r) for r in requests]
    return json.dumps({BATCH_FIELD: members, "min_weight_version": newest}).encode()


def unpack_requests(payload: bytes) -> list[GenerateRequest] | None:
    """The requests of a packed entry; None for a single request's entry."""
    raw = json.loads(payload)
    if BATCH_FIELD not in raw:
        return None
    return [_request_from_dict(member) for member in raw[BATCH_FIELD]]


def entry_demand(payload: bytes) -> tuple[int, int]:
    """(weight version it needs, requests it holds) of a queue entry, single or packed."""
    raw = json.loads(payload)
    return int(raw.get("min_weight_version", 0)), len(raw.get(BATCH_FIELD, [None]))


class InvalidField(InvalidArgument):
    """InvalidArgument naming the request field at fault (the HTTP front reports it as the
    OpenAI error's ``param``); the message starts with the field's name."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name} {problem}")
        self.field = field_name


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidField(name, f"must be an integer in [{low}, {high}], got {value!r}")


def _check_float(name: str, value: object, low: float, high: float = math.inf) -> None:
    """A finite number in [low, high]; NaN and infinities never pass."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidField(name, f"must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise InvalidField(name, f"must be in [{low:g}, {high:g}], got {value!r}")


def _check_text(name: str, value: object, min_chars: int) -> None:
    if not isinstance(value, str) or not min_chars <= len(value) <= MAX_ID_CHARS:
        raise InvalidField(name, f"must be a string of {min_chars}-{MAX_ID_CHARS} characters")


def _check_prompt(token_ids: list[int] | None, text: str | None) -> None:
    if not token_ids and not text:
        raise InvalidField("prompt", "is required (text or token ids)")
    if text is not None and not isinstance(text, str):
        raise InvalidField("prompt_text", "must be a string")
    for token in token_ids or ():
        _check_int("prompt_token_ids", token, 0, INT32_MAX)


def _check_stop(stop: object) -> None:
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS:
        raise InvalidField("sampling.stop", f"must be a list of at most {MAX_STOP_STRINGS} strings")
    if not all(isinstance(s, str) and s for s in stop):
        raise InvalidField("sampling.stop", "must hold non-empty strings")


def _request_from_dict(raw: dict) -> GenerateRequest:
    return GenerateRequest(**{**raw, "sampling": SamplingParams(**raw["sampling"])})


# --- teacher-forced scoring (``Rollout.ScoreTokens``) --------------------------------------
# Why: generation tells which tokens the engine picked, not whether it holds the weights the
# trainer pushed. Scoring the same fixed tokens on a replica and on the actor answers that
# (the trainer's parity probe, ``rlfleet.trainer.weight_check``). Log-probs are
# ``log_softmax(logits)`` at temperature 1: vLLM's prompt log-probs skip its sampling
# processors, and the weights, not the sampling settings, are what is checked.

MAX_SCORED_SEQUENCES = 64
"""A probe is a few sequences; more would be a generation workload through the back door."""
MAX_SCORED_TOKENS = 1 << 14
"""Context plus targets over all sequences of one request."""


@dataclass
class ScoredSequence:
    """``target_token_ids`` each scored given ``prompt_token_ids`` and the targets before it."""

    prompt_token_ids: list[int]
    target_token_ids: list[int]


@dataclass
class ScoreRequest:
    sequences: list[ScoredSequence]
    min_weight_version: int = 0
    """Refused (FailedPrecondition) by a replica serving an older version."""

    def validate(self) -> None:
        """InvalidField naming the first bad field."""
        if not 1 <= len(self.sequences) <= MAX_SCORED_SEQUENCES:
            got = len(self.sequences)
            raise InvalidField(
                "sequences", f"must hold 1 to {MAX_SCORED_SEQUENCES} sequences, got {got}"
            )
        total = 0
        for i, seq in enumerate(self.sequences):
            _check_ids(f"sequences[{i}].prompt_token_ids", seq.prompt_token_ids)
            _check_ids(f"sequences[{i}].target_token_ids", seq.target_token_ids)
            total += len(seq.prompt_token_ids) + len(seq.target_token_ids)
        if total > MAX_SCORED_TOKENS:
            raise InvalidField("sequences", f"hold {total} tokens, more than {MAX_SCORED_TOKENS}")
        version = self.min_weight_version
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version:
            raise InvalidField("min_weight_version", f"must be an integer >= 0, got {version!r}")
        if version > INT64[1]:
            raise InvalidField("min_weight_version", f"must fit in int64, got {version}")


@dataclass
class TokenScores:
    """Per sequence, the log-prob of each target token; the version and replica that scored."""

    logprobs: list[list[float]]
    weight_version: int
    replica_id: str = ""
    seconds: float = field(default=0.0, compare=False)
    """Wall time of the call as the caller measured it (not on the wire)."""


def _check_ids(name: str, ids: list[int]) -> None:
    if not ids:
        raise InvalidField(name, "must hold at least one token id")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
            raise InvalidField(name, f"must be token ids in [0, {INT32_MAX}], got {token!r}")
