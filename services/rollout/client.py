"""Async client for ``rlfleet.v1.Rollout``: one replica, or the router (same Generate).

Callers get plain objects and ``rlfleet.common.errors`` exceptions, never protobuf or
``grpc`` errors: a status code becomes the matching exception (INVALID_ARGUMENT ->
``InvalidArgument``, UNAVAILABLE and DEADLINE_EXCEEDED -> ``Unavailable``, ...) with the
original error chained. The channel retries UNAVAILABLE on its own (see ``grpc_client``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc

from rlfleet.common import errors, weights
from rlfleet.common.grpc_client import auth_metadata, make_channel, wait_ready
from rlfleet.proto import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout import convert
from rlfleet.rollout.types import GenerateRequest, GenerateResult

ERROR_BY_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
}


class RolloutClient:
    """``RolloutClient("127.0.0.1:50051")``; every method is a coroutine."""

    def __init__(self, address: str, api_key: str | None = None, max_message_mb: int = 64) -> None:
        self.address = address
        self._channel = make_channel(address, max_message_mb)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self._metadata = auth_metadata(api_key)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        await wait_ready(self._channel, timeout_s)

    async def generate(
        self, request: GenerateRequest, timeout_s: float | None = None
    ) -> GenerateResult:
        """Completions for one prompt; ``timeout_s`` defaults to the request's own (0 = none)."""
        timeout = timeout_s if timeout_s is not None else (request.timeout_s or None)
        call = self._stub.Generate(convert.request_to_proto(request), timeout=timeout,
                                   metadata=self._metadata)  # fmt: skip
        return convert.result_from_proto(await _checked(call))

    async def status(self) -> dict[str, Any]:
        call = self._stub.GetStatus(common_pb2.Empty(), metadata=self._metadata)
        return convert.status_from_proto(await _checked(call))

    async def flush_cache(self) -> bool:
        call = self._stub.FlushCache(common_pb2.Empty(), metadata=self._metadata)
        return (await _checked(call)).flushed

    async def pause(self) -> dict[str, Any]:
        call = self._stub.Pause(common_pb2.Empty(), metadata=self._metadata)
        return convert.status_from_proto(await _checked(call))

    async def resume(self) -> dict[str, Any]:
        call = self._stub.Resume(common_pb2.Empty(), metadata=self._metadata)
        return convert.status_from_proto(await _checked(call))

    async def push_weights(
        self, header: weights.WeightHeader, payload: bytes,
        chunk_bytes: int = weights.DEFAULT_CHUNK_BYTES, timeout_s: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Stream the header, then the payload in chunks; the replica answers once loaded."""
        messages = _weight_messages(header, payload, chunk_bytes)
        call = self._stub.UpdateWeights(messages, timeout=timeout_s, metadata=self._metadata)
        reply = await _checked(call)
        return {"version": reply.version, "load_seconds": reply.load_seconds,
                "cache_flushed": reply.cache_flushed}  # fmt: skip

    async def send_weight_messages(
        self, messages: AsyncIterator[rollout_pb2.WeightChunk], timeout_s: float | None = None
    ) -> rollout_pb2.UpdateWeightsResponse:
        """Send a hand-made message stream (tests use it to check malformed updates)."""
        call = self._stub.UpdateWeights(messages, timeout=timeout_s, metadata=self._metadata)
        return await _checked(call)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _weight_messages(
    header: weights.WeightHeader, payload: bytes, chunk_bytes: int
) -> AsyncIterator[rollout_pb2.WeightChunk]:
    yield rollout_pb2.WeightChunk(header=convert.header_to_proto(header))
    for chunk in weights.iter_chunks(payload, chunk_bytes):
        yield rollout_pb2.WeightChunk(data=chunk)


async def _checked(call: Awaitable[Any]) -> Any:
    """Await a call, turning a gRPC status into the matching rlfleet exception."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        error_type = ERROR_BY_STATUS.get(exc.code(), errors.RlfleetError)
        raise error_type(f"{exc.code().name}: {exc.details()}") from exc
