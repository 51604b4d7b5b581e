"""Exceptions the services raise, independent of gRPC, and the code each one travels as.

Cores raise these; ``rlfleet.common.grpc_server`` maps them to status codes so a
bad request becomes ``INVALID_ARGUMENT`` (not a crash) and a transient failure becomes
``UNAVAILABLE`` (which clients retry). A failure that crosses Redis (a worker's answer to a
queued job) travels as an ``ErrorCode`` plus a message, so the reader raises the same kind of
exception the worker hit without parsing text: ``code_of`` on one side, ``error_for`` on the other.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """The kinds of failure, numbered like gRPC status codes so the two never disagree."""

    OK = 0
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class RlfleetError(Exception):
    """Base class of errors that carry a status meaning."""


class InvalidArgument(RlfleetError, ValueError):
    """The request is malformed; retrying it unchanged will fail again."""


class NotFound(RlfleetError, KeyError):
    """The named thing (scorer, replica, checkpoint) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class FailedPrecondition(RlfleetError):
    """The service is in a state where it cannot do this now (e.g. paused, updating)."""


class Unavailable(RlfleetError):
    """Transient: no replica, Redis down, deadline inside a queue. Safe to retry."""


class ResourceExhausted(RlfleetError):
    """A bounded resource is full (every replica's queue is at its admission limit): retry
    later, with backoff. Not an ``Unavailable``: the channels' automatic retries must not hammer
    a full fleet, and gRPC uses the same code for a message over the size limit."""


class Unauthenticated(RlfleetError):
    """Missing or wrong API key."""


class DeadlineExceeded(RlfleetError, TimeoutError):
    """The work was not done in time; a TimeoutError, so callers catching that still do."""


class Internal(RlfleetError, RuntimeError):
    """A bug or an unexpected failure on the other side; retrying will likely fail again."""


_EXCEPTION_BY_CODE: dict[ErrorCode, type[RlfleetError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    ErrorCode.INTERNAL: Internal,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
}


def code_of(exc: BaseException) -> ErrorCode:
    """The code ``exc`` travels as; anything not an rlfleet error or a timeout is INTERNAL."""
    for code, kind in _EXCEPTION_BY_CODE.items():
        if isinstance(exc, kind):
            return code
    return ErrorCode.DEADLINE_EXCEEDED if isinstance(exc, TimeoutError) else ErrorCode.INTERNAL


def error_for(code: ErrorCode, message: str) -> RlfleetError:
    """The exception a failure with ``code`` is raised as on the reading side."""
    if code is ErrorCode.OK:
        raise ValueError("ErrorCode.OK is not an error")
    return _EXCEPTION_BY_CODE[code](message)
