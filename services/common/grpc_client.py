"""Client-side gRPC helpers: channels with limits and retries, auth metadata, deadlines."""

from __future__ import annotations

import json

import grpc

from rlfleet.common.grpc_server import message_options

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
