"""A stored answer as the router's caller sees it: a ``GenerateResult``, or the exception it
stands for, with the status code it must carry.

Why one module for it: the single and the batch path read the same answers, and a replica's
refusal must mean the same through both (``INVALID_ARGUMENT`` stays a bad request, anything
else is retryable ``UNAVAILABLE``).
"""

from __future__ import annotations

from rlfleet.common.errors import ErrorCode, InvalidArgument, RlfleetError, Unavailable
from rlfleet.common.queue.results import Result
from rlfleet.rollout.types import GenerateResult

Outcome = GenerateResult | RlfleetError


def unpack(result: Result) -> GenerateResult:
    """The stored answer, or the error it carries as an exception with the right status."""
    return raise_or_return(outcome(result.request_id, result))


def outcome(request_id: str, result: Result) -> Outcome:
    """A stored answer decoded, or the exception its failure stands for (not raised)."""
    if result.ok:
        return GenerateResult.decode(result.payload)
    if result.code is ErrorCode.INVALID_ARGUMENT:
        return InvalidArgument(f"request {request_id}: {result.error}")
    return Unavailable(f"request {request_id} failed on a replica: {result.error}")


def raise_or_return(answer: Outcome) -> GenerateResult:
    if isinstance(answer, Exception):
        raise answer
    return answer


def missing(request_id: str) -> Result:
    """A member whose entry was answered but whose own answer is gone (expired)."""
    return Result(request_id, b"", ErrorCode.UNAVAILABLE, "its answer was not stored")
