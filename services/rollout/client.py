"""Async client for a rollout replica or a router (both serve ``rlfleet.v1.Rollout``).

Callers pass and get the plain objects of ``rlfleet.rollout.types``; the protobuf conversion
lives in ``convert``. A failed call raises the matching ``rlfleet.common.errors`` exception
(``grpc_client.checked``: INVALID_ARGUMENT -> ``InvalidArgument``, UNAVAILABLE ->
``Unavailable``, ...) with the gRPC error chained. The channel retries UNAVAILABLE on its own.
Against a router, ``list_replicas`` and ``drain_replica`` reach its ``Router`` service:
that is how the trainer and ``rlfleet status`` learn the fleet without reading Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from rlfleet.common import call_counts
from rlfleet.common.grpc_client import auth_metadata, checked, make_channel, wait_ready
from rlfleet.model import weights
from rlfleet.proto import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout import convert
from rlfleet.rollout.types import (
    GenerateRequest,
    GenerateResult,
    ReplicaStatus,
    ScoreRequest,
    TokenScores,
    UpdateOutcome,
)


class RolloutClient:
    """``RolloutClient("127.0.0.1:50051")``; every method is a coroutine."""

    def __init__(self, address: str, api_key: str | None = None, max_message_mb: int = 64) -> None:
        self.address = address
        self._channel = make_channel(address, max_message_mb)
        self._stub = rollout_pb2_grpc.RolloutStub(self._channel)
        self._router = rollout_pb2_grpc.RouterStub(self._channel)
        self._update_raw = self._channel.stream_unary(  # messages arrive serialized
            UPDATE_WEIGHTS_METHOD,
            request_serializer=None,
            response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString,
        )
        self._metadata = auth_metadata(api_key)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        await wait_ready(self._channel, timeout_s)

    async def generate(
        self, request: GenerateRequest, timeout_s: float | None = None
    ) -> GenerateResult:
        """Completions for one prompt; ``timeout_s`` defaults to the request's own (0 = none)."""
        timeout = timeout_s if timeout_s is not None else (request.timeout_s or None)
        call = self._stub.Generate(
            convert.request_to_proto(request), timeout=timeout, metadata=self._metadata
        )
        return convert.result_from_proto(await checked(call))

    async def generate_batch(
        self, requests: Sequence[GenerateRequest], timeout_s: float | None = None
    ) -> list[GenerateResult]:
        """Completions for many prompts in one call (one training step), in request order.
        Through a router, each replica gets its share as one queue entry, so its engine
        batches the whole share. ``timeout_s`` defaults to the longest request timeout (0 =
        none); any request's failure fails the call, with that request's error."""
        if not requests:
            return []
        own = max(r.timeout_s for r in requests) or None
        call = self._stub.GenerateBatch(
            convert.batch_to_proto(requests),
            timeout=own if timeout_s is None else timeout_s,
            metadata=self._metadata,
        )
        return convert.batch_results_from_proto(await checked(call))

    async def status(self) -> ReplicaStatus:
        call = self._stub.GetStatus(common_pb2.Empty(), metadata=self._metadata)
        return convert.status_from_proto(await checked(call))

    async def flush_cache(self) -> bool:
        call = self._stub.FlushCache(common_pb2.Empty(), metadata=self._metadata)
        return (await checked(call)).flushed

    async def pause(self) -> ReplicaStatus:
        call = self._stub.Pause(common_pb2.Empty(), metadata=self._metadata)
        return convert.status_from_proto(await checked(call))

    async def resume(self) -> ReplicaStatus:
        call = self._stub.Resume(common_pb2.Empty(), metadata=self._metadata)
        return convert.status_from_proto(await checked(call))

    async def push_weights(
        self,
        header: weights.WeightHeader,
        payload: weights.BytesLike,
        chunk_bytes: int = weights.DEFAULT_CHUNK_BYTES,
        timeout_s: float | None = None,
    ) -> UpdateOutcome:
        """Stream the header, then the payload in chunks; the replica answers once loaded,
        with the version it now serves."""
        return await self.push_prepared(PreparedUpdate.of(header, payload, chunk_bytes), timeout_s)

    async def push_prepared(
        self, update: PreparedUpdate, timeout_s: float | None = None
    ) -> UpdateOutcome:
        """Send messages serialized once for every replica (``PreparedUpdate``)."""
        call_counts.record(UPDATE_WEIGHTS_METHOD)  # client streams are not intercepted
        call = self._update_raw(iter(update.messages), timeout=timeout_s, metadata=self._metadata)
        return convert.outcome_from_proto(await checked(call))

    async def push_messages(
        self, messages: AsyncIterator[bytes], timeout_s: float | None = None
    ) -> UpdateOutcome:
        """Send serialized ``WeightChunk`` messages as they come (a relaying replica forwards
        each chunk it receives while the rest is still arriving)."""
        call_counts.record(UPDATE_WEIGHTS_METHOD)
        call = self._update_raw(messages, timeout=timeout_s, metadata=self._metadata)
        return convert.outcome_from_proto(await checked(call))

    async def send_weight_messages(
        self, messages: AsyncIterator[rollout_pb2.WeightChunk], timeout_s: float | None = None
    ) -> UpdateOutcome:
        """Send a hand-made message stream (tests use it to check malformed updates)."""
        call_counts.record(UPDATE_WEIGHTS_METHOD)
        call = self._stub.UpdateWeights(messages, timeout=timeout_s, metadata=self._metadata)
        return convert.outcome_from_proto(await checked(call))

    async def score_tokens(
        self, request: ScoreRequest, timeout_s: float | None = 60.0
    ) -> TokenScores:
        """Teacher-forced log-probs of the request's targets (a replica only; the trainer's
        parity probe: ``rlfleet.rollout.types.ScoreRequest``)."""
        call = self._stub.ScoreTokens(
            convert.score_request_to_proto(request), timeout=timeout_s, metadata=self._metadata
        )
        return convert.scores_from_proto(await checked(call))

    async def list_replicas(self, timeout_s: float | None = 10.0) -> list[ReplicaStatus]:
        """Every replica a router knows, with its state as routing sees it (router only)."""
        call = self._router.ListReplicas(
            common_pb2.Empty(), timeout=timeout_s, metadata=self._metadata
        )
        return [convert.status_from_proto(r) for r in (await checked(call)).replicas]

    async def drain_replica(self, replica_id: str) -> ReplicaStatus:
        """Stop the router sending new work to one replica (router only)."""
        request = rollout_pb2.DrainReplicaRequest(replica_id=replica_id)
        call = self._router.DrainReplica(request, metadata=self._metadata)
        return convert.status_from_proto(await checked(call))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


@dataclass(frozen=True)
class PreparedUpdate:
    """One weight update as serialized ``WeightChunk`` messages (header first, then data).

    Why serialize by hand: protobuf only takes ``bytes`` for a bytes field, so building a
    ``WeightChunk`` per chunk costs a slice copy, a message copy and a serialization copy, for
    every replica. Here each data message is written once, straight from a ``memoryview`` of
    the payload, in protobuf's wire format (field 2, length-delimited), and the same messages
    go to every replica.
    """

    version: int
    total_bytes: int
    messages: tuple[bytes, ...]

    @classmethod
    def of(
        cls, header: weights.WeightHeader, payload: weights.BytesLike, chunk_bytes: int
    ) -> PreparedUpdate:
        data = (_data_message(chunk) for chunk in weights.iter_chunks(payload, chunk_bytes))
        return cls(header.version, len(payload), (header_message(header), *data))

    def headed(self, header: weights.WeightHeader) -> PreparedUpdate:
        """The same data messages under another header (the same payload: a relay tree)."""
        return replace(self, messages=(header_message(header), *self.messages[1:]))


def header_message(header: weights.WeightHeader) -> bytes:
    """A serialized ``WeightChunk(header=...)``, the first message of an update."""
    return rollout_pb2.WeightChunk(header=convert.header_to_proto(header)).SerializeToString()


UPDATE_WEIGHTS_METHOD = "/rlfleet.v1.Rollout/UpdateWeights"
_DATA_TAG = b"\x12"  # WeightChunk.data: field 2, wire type 2 (length-delimited)


def _data_message(chunk: memoryview) -> bytes:
    """A serialized ``WeightChunk(data=chunk)``: tag, varint length, bytes (one copy)."""
    return b"".join((_DATA_TAG, _varint(len(chunk)), chunk))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
