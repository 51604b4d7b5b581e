"""gRPC glue for one rollout replica: ``rlfleet.v1.Rollout`` over ``Replica``.

Each method converts the proto, calls the replica core, and converts the answer back; errors
are plain ``rlfleet.common.errors`` exceptions that ``GrpcServer``'s interceptor maps to status
codes (a bad update is INVALID_ARGUMENT, a paused or starting replica UNAVAILABLE).

UpdateWeights is a client stream: a header first, then raw byte chunks. The replica checks the
header (version, and size against its model) before one buffer of ``total_bytes`` is allocated;
chunks are written into it in place and never past it, so a lying sender cannot exhaust memory;
the checksum is verified by the replica before any weight changes. A header naming a
shared-memory file (``weights_shm``: the trainer is on this machine) comes alone, and the
payload is read from that file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import cast

import grpc

from rlfleet.common.errors import InvalidArgument, RlfleetError
from rlfleet.common.grpc_server import Registration
from rlfleet.common.proto_decode import read_varint
from rlfleet.model import weights, weights_shm
from rlfleet.proto import rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout import convert
from rlfleet.rollout.replica import Replica
from rlfleet.rollout.weight_broadcast import BroadcastMember
from rlfleet.rollout.weight_relay import Relay, RelayLinks

SERVICE_NAME = "rlfleet.v1.Rollout"


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, replica: Replica, relays: RelayLinks) -> None:
        self._replica, self._relays = replica, relays
        self._broadcasts = BroadcastMember()  # the trainer's group, when a header names one

    async def Generate(self, request, context):  # noqa: N802 - gRPC method names
        result = await self._replica.generate_direct(convert.request_from_proto(request))
        return convert.result_to_proto(result)

    async def GenerateBatch(self, request, context):  # noqa: N802
        """All requests at once, so the engine batches them together; answers in order."""
        requests = convert.batch_from_proto(request)
        _check_distinct([r.request_id for r in requests])
        results = await asyncio.gather(*(self._replica.generate_direct(r) for r in requests))
        return convert.batch_results_to_proto(results)

    async def UpdateWeights(self, request_iterator, context):  # noqa: N802
        relay = None
        try:
            header = await _receive_header(request_iterator)
            self._replica.check_update(header)  # before allocating anything for the payload
            if header.shared_memory:
                payload = await _shared_payload(request_iterator, header)
            elif header.broadcast is not None:  # no chunks: the bytes come on the group
                payload = await self._broadcasts.receive(header)
            else:
                relay = self._relays.start(header)  # forwards chunks as they arrive
                buffer = weights.PayloadBuffer(header.total_bytes)
                payload = await _receive_payload(request_iterator, buffer, relay)
        except BaseException as exc:
            if relay is not None:
                relay.abort()  # no child may apply a part of it
            if isinstance(exc, RlfleetError):
                await _discard_rest(request_iterator, REFUSED_STREAM_DRAIN_S)
            raise
        if relay is None:
            return convert.outcome_to_proto(await self._replica.update_weights(header, payload))
        own = asyncio.ensure_future(self._replica.update_weights(header, payload))
        relayed = await relay.finish()  # the children verify and apply beside us
        outcome = dataclasses.replace(await own, relayed=relayed)
        return convert.outcome_to_proto(outcome)

    async def FlushCache(self, request, context):  # noqa: N802
        return rollout_pb2.FlushCacheResponse(flushed=await self._replica.flush_cache())

    async def Pause(self, request, context):  # noqa: N802
        return convert.status_to_proto(await self._replica.pause())

    async def Resume(self, request, context):  # noqa: N802
        return convert.status_to_proto(await self._replica.resume())

    async def GetStatus(self, request, context):  # noqa: N802
        return convert.status_to_proto(self._replica.status())

    async def ScoreTokens(self, request, context):  # noqa: N802
        scores = await self._replica.score_tokens(convert.score_request_from_proto(request))
        return convert.scores_to_proto(scores)


UpdateMessage = rollout_pb2.WeightChunk | memoryview  # a data chunk arrives as a memoryview
UPDATE_WEIGHTS = "UpdateWeights"
_DATA_TAG = 0x12  # WeightChunk.data: field 2, length-delimited
REFUSED_STREAM_DRAIN_S = 5.0  # bounded; 2 s was too short to read 128 MiB at load 20 (CI)


async def _discard_rest(messages: AsyncIterator[UpdateMessage], limit_s: float) -> None:
    """Read and drop what the sender is still streaming after a refusal, for up to ``limit_s``.

    Why: a gRPC Python client still writing when the server answers early sees
    ``INTERNAL: Internal error from Core`` instead of the refusal (grpc/grpc#36066). Letting
    it finish sending costs bandwidth but no memory (nothing is kept), and it then reads the
    real status. A sender that is still going after ``limit_s`` is answered anyway.
    """
    with contextlib.suppress(Exception):  # the stream breaking or running long: answer now
        async with asyncio.timeout(limit_s):
            async for _ in messages:
                pass


async def _receive_header(messages: AsyncIterator[UpdateMessage]) -> weights.WeightHeader:
    """The header, which must come first."""
    first = await anext(aiter(messages), None)
    if not isinstance(first, rollout_pb2.WeightChunk) or first.WhichOneof("kind") != "header":
        raise InvalidArgument("UpdateWeights: the first message must be the header")
    return convert.header_from_proto(first.header)


async def _receive_payload(
    messages: AsyncIterator[UpdateMessage], buffer: weights.PayloadBuffer, relay: Relay | None
) -> memoryview:
    """Data chunks written into ``buffer`` (which refuses more than it holds), each forwarded
    as received to the relay's children, then the whole."""
    async for message in messages:
        if isinstance(message, memoryview):
            buffer.write(message)
            raw = cast(bytes, message.obj)  # the received message (``parse_update_message``)
        elif message.WhichOneof("kind") == "data":
            buffer.write(message.data)
            raw = message.SerializeToString()
        else:
            raise InvalidArgument("UpdateWeights: only one header, then data chunks")
        if relay is not None:
            await relay.forward(raw)
    return buffer.payload()


async def _shared_payload(
    messages: AsyncIterator[UpdateMessage], header: weights.WeightHeader
) -> memoryview:
    """The payload file the header names (NotFound off the trainer's host); no chunks may
    follow such a header."""
    async for _ in messages:
        raise InvalidArgument("UpdateWeights: a shared-memory header takes no data chunks")
    return await asyncio.to_thread(
        weights_shm.open_shared, header.shared_memory, header.total_bytes
    )


def parse_update_message(raw: bytes) -> UpdateMessage:
    """A data chunk as a view of the received bytes; anything else parsed as a WeightChunk.

    Why: parsing a 4 MiB chunk with protobuf and reading ``.data`` allocates and copies it
    twice more, which cost ten times the memcpy itself on a busy machine. A message that is
    exactly one ``data`` field is read in place; every other one takes the protobuf path.
    """
    view = memoryview(raw)
    if view[:1] == bytes((_DATA_TAG,)):
        with contextlib.suppress(ValueError):  # a cut varint takes the protobuf path
            length, start = read_varint(view, 1)
            if start + length == len(view):
                return view[start:]
    return rollout_pb2.WeightChunk.FromString(raw)


class _RawUpdateServer:
    """Stands in for the server during the generated registration, swapping in
    ``parse_update_message`` as UpdateWeights' deserializer (every other method unchanged)."""

    def __init__(self, server: grpc.aio.Server, servicer: RolloutServicer) -> None:
        self._server = server
        self._handler = grpc.stream_unary_rpc_method_handler(
            servicer.UpdateWeights,
            request_deserializer=parse_update_message,
            response_serializer=rollout_pb2.UpdateWeightsResponse.SerializeToString,
        )

    def add_generic_rpc_handlers(self, handlers) -> None:
        mine = grpc.method_handlers_generic_handler(SERVICE_NAME, {UPDATE_WEIGHTS: self._handler})
        self._server.add_generic_rpc_handlers((mine, *handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        handlers = {**handlers, UPDATE_WEIGHTS: self._handler}
        self._server.add_registered_method_handlers(service, handlers)


def _add_to_server(servicer: RolloutServicer, server: grpc.aio.Server) -> None:
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, _RawUpdateServer(server, servicer))


def _check_distinct(request_ids: list[str]) -> None:
    if len(set(request_ids)) != len(request_ids):
        raise InvalidArgument("request ids in a batch must be distinct")


def registration(replica: Replica, relays: RelayLinks) -> Registration:
    return Registration(_add_to_server, RolloutServicer(replica, relays), SERVICE_NAME)
