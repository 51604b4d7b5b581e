"""gRPC glue for one rollout replica: ``rlfleet.v1.Rollout`` over ``Replica``.

Each method converts the proto, calls the replica core, and converts the answer back; errors
are plain ``rlfleet.common.errors`` exceptions that ``GrpcServer``'s interceptor maps to status
codes (a bad update is INVALID_ARGUMENT, a paused or starting replica UNAVAILABLE).

UpdateWeights is a client stream: a header first, then raw byte chunks. The replica checks the
header (version, and size against its model) before one buffer of ``total_bytes`` is allocated;
chunks are written into it in place and never past it, so a lying sender cannot exhaust memory;
the checksum is verified by the replica before any weight changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from rlfleet.common import weights
from rlfleet.common.errors import InvalidArgument
from rlfleet.common.grpc_server import Registration
from rlfleet.proto import rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout import convert
from rlfleet.rollout.replica import Replica

SERVICE_NAME = "rlfleet.v1.Rollout"


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, replica: Replica) -> None:
        self._replica = replica

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
        header = await _receive_header(request_iterator)
        self._replica.check_update(header)  # before allocating anything for the payload
        buffer = weights.PayloadBuffer(header.total_bytes)
        payload = await _receive_payload(request_iterator, buffer)
        return convert.outcome_to_proto(await self._replica.update_weights(header, payload))

    async def FlushCache(self, request, context):  # noqa: N802
        return rollout_pb2.FlushCacheResponse(flushed=await self._replica.flush_cache())

    async def Pause(self, request, context):  # noqa: N802
        return convert.status_to_proto(await self._replica.pause())

    async def Resume(self, request, context):  # noqa: N802
        return convert.status_to_proto(await self._replica.resume())

    async def GetStatus(self, request, context):  # noqa: N802
        return convert.status_to_proto(self._replica.status())


async def _receive_header(
    messages: AsyncIterator[rollout_pb2.WeightChunk],
) -> weights.WeightHeader:
    """The header, which must come first."""
    first = await anext(aiter(messages), None)
    if first is None or first.WhichOneof("kind") != "header":
        raise InvalidArgument("UpdateWeights: the first message must be the header")
    return convert.header_from_proto(first.header)


async def _receive_payload(
    messages: AsyncIterator[rollout_pb2.WeightChunk], buffer: weights.PayloadBuffer
) -> memoryview:
    """Data chunks written into ``buffer`` (which refuses more than it holds), then the whole."""
    async for message in messages:
        if message.WhichOneof("kind") != "data":
            raise InvalidArgument("UpdateWeights: only one header, then data chunks")
        buffer.write(message.data)
    return buffer.payload()


def _check_distinct(request_ids: list[str]) -> None:
    if len(set(request_ids)) != len(request_ids):
        raise InvalidArgument("request ids in a batch must be distinct")


def registration(replica: Replica) -> Registration:
    return Registration(
        rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(replica), SERVICE_NAME
    )
