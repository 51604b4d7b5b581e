"""gRPC glue for the router: proto <-> plain objects around ``RouterCore``.

The router serves ``rlfleet.v1.Rollout`` so a client can talk to it exactly like to one
replica, but only generation (``Generate``, ``GenerateBatch``) makes sense fleet-wide; control
RPCs (weights, cache, pause) target one engine and must go to each replica directly, so here
they answer UNIMPLEMENTED with a message saying where to go. (Moving them to a service of their own would drop these
stubs, but ``Rollout``'s RPC names are a pinned contract: see docs/architecture.md.)
"""

from __future__ import annotations

from rlfleet.common.grpc_server import Registration
from rlfleet.proto import rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout.convert import (
    batch_from_proto,
    batch_results_to_proto,
    request_from_proto,
    result_to_proto,
    status_to_proto,
)
from rlfleet.rollout.router.core import RouterCore

DIRECT_ONLY = (
    "the router only routes Generate and GenerateBatch; call {} on each replica directly "
    "(addresses from Router.ListReplicas)"
)


def _direct_only(name: str):
    """A servicer method that refuses, naming the replica RPC to call instead."""

    async def refuse(self, request, context):  # noqa: ANN001 - gRPC servicer signature
        raise NotImplementedError(DIRECT_ONLY.format(name))

    return refuse


class RouterRolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """``Rollout`` as served by the router: generation is routed, the rest is per-replica."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core

    async def Generate(self, request, context):  # noqa: N802 - gRPC method names
        return result_to_proto(await self._core.generate(request_from_proto(request)))

    async def GenerateBatch(self, request, context):  # noqa: N802
        return batch_results_to_proto(await self._core.generate_batch(batch_from_proto(request)))

    UpdateWeights = _direct_only("UpdateWeights")
    FlushCache = _direct_only("FlushCache")
    Pause = _direct_only("Pause")
    Resume = _direct_only("Resume")
    GetStatus = _direct_only("GetStatus")
    ScoreTokens = _direct_only("ScoreTokens")


class RouterServicer(rollout_pb2_grpc.RouterServicer):
    """Fleet view and control: list replicas, drain one before taking it down."""

    def __init__(self, core: RouterCore) -> None:
        self._core = core

    async def ListReplicas(self, request, context):  # noqa: N802
        views = await self._core.list_replicas()
        return rollout_pb2.ListReplicasResponse(
            replicas=[status_to_proto(v.status()) for v in views]
        )

    async def DrainReplica(self, request, context):  # noqa: N802
        view = await self._core.drain_replica(request.replica_id)
        return status_to_proto(view.status())


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
