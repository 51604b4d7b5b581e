"""Client-side gRPC helpers: channels with limits and retries, auth metadata, deadlines, and
the one map from a failed call's status code to the rlfleet exception it stands for.

Why one map: every role's client raises the same exception for the same status (the server
side maps exceptions to codes in ``grpc_server``), so callers catch ``InvalidArgument`` or
``Unavailable`` whichever service they called, and never import grpc themselves.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from rlfleet.common import errors
from rlfleet.common.grpc_server import message_options

T = TypeVar("T")

ERROR_BY_STATUS: dict[grpc.StatusCode, type[errors.RlfleetError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
}
"""Any other code (INTERNAL, UNIMPLEMENTED, UNKNOWN, ...) becomes ``errors.Internal``."""

RETRY_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


def make_channel(address: str, max_message_mb: int = 64, retry: bool = True) -> grpc.aio.Channel:
    """An insecure aio channel (loopback / private network) that retries UNAVAILABLE."""
    options = [*message_options(max_message_mb), ("grpc.enable_retries", int(retry))]
    if retry:
        options.append(("grpc.service_config", json.dumps(RETRY_SERVICE_CONFIG)))
    return grpc.aio.insecure_channel(address, options=options)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to send with every call when the fleet has an API key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


async def wait_ready(channel: grpc.aio.Channel, timeout_s: float) -> None:
    """Wait until the channel connects, or raise TimeoutError naming the target."""
    import asyncio

    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"gRPC server not reachable within {timeout_s:.0f}s") from exc


def error_from_rpc(exc: grpc.aio.AioRpcError, service: str = "") -> errors.RlfleetError:
    """The rlfleet exception a failed call stands for; raise it ``from exc`` to keep the code."""
    error_type = ERROR_BY_STATUS.get(exc.code(), errors.Internal)
    prefix = f"{service} " if service else ""
    return error_type(f"{prefix}{exc.code().name}: {exc.details()}")


async def checked(call: Awaitable[T], service: str = "") -> T:
    """Await a call, turning a gRPC status into the matching rlfleet exception."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc, service) from exc
