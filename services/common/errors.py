"""Exceptions the services raise, independent of gRPC.

Cores raise these; ``rlfleet.common.grpc_server`` maps them to status codes so a
bad request becomes ``INVALID_ARGUMENT`` (not a crash) and a transient failure becomes
``UNAVAILABLE`` (which clients retry).
"""


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


class Unauthenticated(RlfleetError):
    """Missing or wrong API key."""
