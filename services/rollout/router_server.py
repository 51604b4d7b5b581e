"""gRPC glue for the router: proto <-> plain objects around ``RouterCore``.

The router serves ``rlfleet.v1.Rollout`` so a client can talk to it exactly like to one
replica, but only ``Generate`` makes sense fleet-wide; control RPCs (weights, cache, pause)
target one engine and must go to each replica directly, so here they answer UNIMPLEMENTED.
"""

from __future__ import annotations

from rlfleet.common.grpc_server import Registration
from rlfleet.proto import rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout.convert import request_from_proto, result_to_proto
from rlfleet.rollout.router import ReplicaView, RouterCore

DIRECT_ONLY = (
    "the router only routes Generate; call {} on each replica directly "
    "(addresses from Router.ListReplicas)"
)


def status_to_proto(view: ReplicaView) -> rollout_pb2.ReplicaStatus:
    info = view.info
    return rollout_pb2.ReplicaStatus(
        replica_id=info.replica_id,
        address=info.address,
        weight_version=info.weight_version,
        state=view.state,
        in_flight=view.in_flight,
        backend=info.backend,
        served=info.served,
        heartbeat_age_s=info.heartbeat_age_s,
    )


class RouterRolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """``Rollout`` as served by the router: Generate is routed, the rest is per-replica."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core

    async def Generate(self, request, context):  # noqa: N802 - gRPC method names
        return result_to_proto(await self._core.generate(request_from_proto(request)))

    async def UpdateWeights(self, request_iterator, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("UpdateWeights"))

    async def FlushCache(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("FlushCache"))

    async def Pause(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("Pause"))

    async def Resume(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("Resume"))

    async def GetStatus(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("GetStatus"))


class RouterServicer(rollout_pb2_grpc.RouterServicer):
    """Fleet view and control: list replicas, drain one before taking it down."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core

    async def ListReplicas(self, request, context):  # noqa: N802
        views = await self._core.list_replicas()
        return rollout_pb2.ListReplicasResponse(replicas=[status_to_proto(v) for v in views])

    async def DrainReplica(self, request, context):  # noqa: N802
        return status_to_proto(await self._core.drain_replica(request.replica_id))


def registrations(core: RouterCore) -> list[Registration]:
    """Both services the router answers, ready for ``GrpcServer``."""
    return [
        Registration(
            rollout_pb2_grpc.add_RolloutServicer_to_server,
            RouterRolloutServicer(core),
            "rlfleet.v1.Rollout",
        ),
        Registration(
            rollout_pb2_grpc.add_RouterServicer_to_server, RouterServicer(core), "rlfleet.v1.Router"
        ),
    ]
