"""Plain objects for scoring, shared by the reward front doors, its workers and its clients.

They travel through Redis as JSON (a queue job is a chunk of requests: ``encode_requests``,
``decode_results``), so neither the service core nor the workers need protobuf; ``server.py``
converts to and from proto and ``http.py`` to and from request bodies. ``from_dict`` checks
types as well as names, because HTTP and JSONL callers can send anything, and a malformed item
must be rejected as ``InvalidArgument`` up front rather than crash a worker later.

``ground_truth`` is any JSON value and reaches the scorer as that value (verl datasets hold
strings, numbers, lists of accepted answers, dicts of test cases): JSON keeps it as is, and the
proto carries a non-string one in ``ground_truth_value``. ``id`` may be left empty: the service
numbers such items by their position in the batch (``fill_ids``).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from rlfleet.common.errors import InvalidArgument

MAX_ID_CHARS = 256
MAX_TEXT_BYTES = 1 << 20  # solution_str, ground_truth and extra_info (as JSON) each
MAX_BATCH_ITEMS = 65_536


@dataclass
class ScoreRequest:
    """One response to score; ``scorer`` (a scorer name) overrides the ``data_source`` lookup."""

    id: str
    data_source: str
    solution_str: str
    ground_truth: Any = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    scorer: str | None = None
    prompt: str = ""

    def validate(self) -> None:
        """Raise InvalidArgument for anything a scorer should never see."""
        _check_types(self)
        if not self.id or len(self.id) > MAX_ID_CHARS:
            raise InvalidArgument(f"id must be 1-{MAX_ID_CHARS} characters, got {len(self.id)}")
        if not self.data_source and not self.scorer:
            raise InvalidArgument(f"request {self.id!r}: data_source or scorer is required")
        _check_size(self.id, "solution_str", self.solution_str)
        _check_size(self.id, "prompt", self.prompt)
        _check_size(self.id, "ground_truth", _json_text(self, "ground_truth", self.ground_truth))
        _check_size(self.id, "extra_info", _json_text(self, "extra_info", self.extra_info))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> ScoreRequest:
        """Build from a JSON object; unknown or mistyped fields are InvalidArgument."""
        request = cls(**{**_DEFAULTS, **_known_fields(cls, raw, optional=set(_DEFAULTS))})
        _check_types(request)
        return request

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ScoreRequest:
        return cls.from_dict(_loads(data))


@dataclass
class ScoreResult:
    """The score of one request; ``error`` is non-empty when it could not be scored."""

    id: str
    score: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any) -> ScoreResult:
        result = cls(**_known_fields(cls, raw))
        result.score = float(result.score)
        result.metrics = {str(k): float(v) for k, v in (result.metrics or {}).items()}
        return result

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ScoreResult:
        return cls.from_dict(_loads(data))


@dataclass
class ScorerInfo:
    """What ``ListScorers`` reports about one scorer."""

    name: str
    kind: str  # "builtin" | "user" | "model"
    data_sources: list[str]
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fill_ids(requests: list[ScoreRequest]) -> None:
    """Number the items that came without an id by their position (callers match by order)."""
    for index, request in enumerate(requests):
        if request.id == "":
            request.id = str(index)


def validate_batch(requests: list[ScoreRequest]) -> None:
    """Validate every item and reject duplicate ids (results are matched back by id)."""
    if len(requests) > MAX_BATCH_ITEMS:
        raise InvalidArgument(f"batch of {len(requests)} exceeds {MAX_BATCH_ITEMS} items")
    seen: set[str] = set()
    for request in requests:
        request.validate()
        if request.id in seen:
            raise InvalidArgument(f"duplicate id {request.id!r} in one batch")
        seen.add(request.id)


def finite_metrics(raw: dict[str, Any]) -> dict[str, float]:
    """Numeric, finite entries only (JSON has no NaN and a metric of NaN says nothing)."""
    out = {}
    for key, value in raw.items():
        number = as_number(value)
        if number is not None and math.isfinite(number):
            out[str(key)] = number
    return out


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (bool and numpy scalars included)."""
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


_TEXT_FIELDS = ("id", "data_source", "solution_str", "prompt")
_DEFAULTS = {"id": "", "data_source": ""}  # optional in JSON bodies


def check_types(request: ScoreRequest) -> None:
    """InvalidArgument naming the first field of the wrong type (clients check before sending)."""
    _check_types(request)


def _check_types(request: ScoreRequest) -> None:
    for name in _TEXT_FIELDS:
        if not isinstance(getattr(request, name), str):
            kind = type(getattr(request, name)).__name__
            raise InvalidArgument(f"{name} must be a string, got {kind}")
    if not isinstance(request.extra_info, dict):
        kind = type(request.extra_info).__name__
        raise InvalidArgument(f"extra_info must be an object (dict), got {kind}")
    if request.scorer is not None and not isinstance(request.scorer, str):
        raise InvalidArgument("scorer must be a string or null")
    if request.scorer == "":
        request.scorer = None


def _check_size(request_id: str, name: str, text: str) -> None:
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_TEXT_BYTES:
        raise InvalidArgument(
            f"request {request_id!r}: {name} is {size} bytes (limit {MAX_TEXT_BYTES})"
        )


def _json_text(request: ScoreRequest, name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"request {request.id!r}: {name} is not JSON: {exc}") from exc


def _known_fields(cls: type, raw: Any, optional: set[str] | None = None) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{cls.__name__} must be a JSON object, got {type(raw).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise InvalidArgument(f"unknown {cls.__name__} fields: {sorted(unknown)}")
    raw = {k: v for k, v in raw.items() if v is not None or k == "scorer"}
    missing = {f.name for f in fields(cls) if _required(f)} - set(raw) - (optional or set())
    if missing:
        raise InvalidArgument(f"missing {cls.__name__} fields: {sorted(missing)}")
    return raw


def _required(f: Any) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise InvalidArgument(f"not valid JSON: {exc}") from exc


def encode_requests(requests: list[ScoreRequest]) -> bytes:
    """One queue job's payload: a chunk of requests."""
    return json.dumps({"requests": [r.to_dict() for r in requests]}).encode()


def decode_requests(data: bytes) -> list[ScoreRequest]:
    raw = _loads(data)
    items = raw.get("requests") if isinstance(raw, dict) else None
    if not isinstance(items, list):
        raise InvalidArgument('a scoring job must be {"requests": [...]}')
    return [ScoreRequest.from_dict(item) for item in items]


def encode_results(results: list[ScoreResult]) -> bytes:
    return json.dumps({"results": [r.to_dict() for r in results]}).encode()


def decode_results(data: bytes) -> list[ScoreResult]:
    return [ScoreResult.from_dict(item) for item in _loads(data)["results"]]
