"""gRPC glue for one rollout replica: ``rlfleet.v1.Rollout`` over ``Replica``.

Each method converts the proto, calls the replica core, and converts the answer back; errors
are plain ``rlfleet.common.errors`` exceptions that ``GrpcServer``'s interceptor maps to status
codes (a bad update is INVALID_ARGUMENT, a paused or starting replica UNAVAILABLE).

UpdateWeights is a client stream: a header first, then raw byte chunks. The bytes are buffered
only up to the ``total_bytes`` the header announced, so a lying sender cannot exhaust memory;
size and checksum are verified by the replica before any weight changes.
"""

from __future__ import annotations

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

    async def UpdateWeights(self, request_iterator, context):  # noqa: N802
        header, payload = await receive_update(request_iterator)
        return convert.outcome_to_proto(await self._replica.update_weights(header, payload))

    async def FlushCache(self, request, context):  # noqa: N802
        return rollout_pb2.FlushCacheResponse(flushed=await self._replica.flush_cache())

    async def Pause(self, request, context):  # noqa: N802
        return convert.status_to_proto(await self._replica.pause())

    async def Resume(self, request, context):  # noqa: N802
        return convert.status_to_proto(await self._replica.resume())

    async def GetStatus(self, request, context):  # noqa: N802
        return convert.status_to_proto(self._replica.status())


async def receive_update(
    messages: AsyncIterator[rollout_pb2.WeightChunk],
) -> tuple[weights.WeightHeader, bytes]:
    """The header (which must come first) and the joined payload, bounded by its total_bytes."""
    first = await anext(aiter(messages), None)
    if first is None or first.WhichOneof("kind") != "header":
        raise InvalidArgument("UpdateWeights: the first message must be the header")
    header = convert.header_from_proto(first.header)
    chunks, received = [], 0
    async for message in messages:
        if message.WhichOneof("kind") != "data":
            raise InvalidArgument("UpdateWeights: only one header, then data chunks")
        received += len(message.data)
        if received > header.total_bytes:
            raise InvalidArgument(
                f"weight payload exceeds the announced {header.total_bytes} bytes"
            )
        chunks.append(message.data)
    return header, weights.join_chunks(chunks, header.total_bytes)


def registration(replica: Replica) -> Registration:
    return Registration(
        rollout_pb2_grpc.add_RolloutServicer_to_server, RolloutServicer(replica), SERVICE_NAME
    )
