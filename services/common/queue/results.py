"""A work queue's answers: a payload, or an error code and message, stored as one Redis string.

Kept apart from ``workqueue.py`` so the queue module stays about delivery; both the queue and
the readers that fetch answers without a queue (the router's fast path) decode through here.
A failure carries an ``ErrorCode`` rather than an exception name inside its text, so readers
raise the right exception (``Result.unwrap``) without parsing messages.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rlfleet.common.errors import ErrorCode, code_of, error_for

_HEADER = struct.Struct(">Bi")  # error code, message length in bytes


@dataclass(frozen=True)
class Failure:
    """Why a job could not be answered with a payload."""

    code: ErrorCode
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """The failure ``exc`` stands for; an unexpected exception keeps its type name in
        the message, since the code alone (INTERNAL) would not say what went wrong."""
        code = code_of(exc)
        return cls(code, f"{type(exc).__name__}: {exc}" if code is ErrorCode.INTERNAL else str(exc))


@dataclass(frozen=True)
class Result:
    """The answer to a request: a payload, or a failure code and message (payload then b"")."""

    request_id: str
    payload: bytes
    code: ErrorCode = ErrorCode.OK
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.code is ErrorCode.OK

    @property
    def error(self) -> str | None:
        """The failure's message for people (logs, per-item error fields); None when ok."""
        return None if self.ok else self.message

    def unwrap(self) -> bytes:
        """The payload, or the rlfleet exception matching the failure's code."""
        if self.ok:
            return self.payload
        raise error_for(self.code, self.message)


def encode_result(payload: bytes, failure: Failure | None = None) -> bytes:
    """A 1-byte code, a 4-byte message length, the UTF-8 message, then the payload."""
    if failure is None:
        return _HEADER.pack(ErrorCode.OK, 0) + payload
    message = failure.message.encode()
    return _HEADER.pack(failure.code, len(message)) + message + payload


def decode_result(request_id: str, raw: bytes) -> Result:
    """The stored answer; an unknown code (a newer writer) reads as INTERNAL."""
    value, size = _HEADER.unpack_from(raw)
    start = _HEADER.size
    message = raw[start : start + size].decode(errors="replace")
    return Result(request_id, raw[start + size :], _code(value), message)


def _code(value: int) -> ErrorCode:
    try:
        return ErrorCode(value)
    except ValueError:
        return ErrorCode.INTERNAL
