"""A work queue's answers: a payload or an error message, stored as one Redis string.

Kept apart from ``workqueue.py`` so the queue module stays about delivery; both the queue and
the readers that fetch answers without a queue (the router's fast path) decode through here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    """The answer to a request: a payload, or an error message (then payload is usually b"")."""

    request_id: str
    payload: bytes
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def encode_result(payload: bytes, error: str | None) -> bytes:
    """A 4-byte error length (-1: no error), the UTF-8 error message, then the payload."""
    message = b"" if error is None else error.encode()
    return struct.pack(">i", -1 if error is None else len(message)) + message + payload


def decode_result(request_id: str, raw: bytes) -> Result:
    (size,) = struct.unpack_from(">i", raw)
    if size < 0:
        return Result(request_id, raw[4:])
    return Result(request_id, raw[4 + size :], raw[4 : 4 + size].decode(errors="replace"))
