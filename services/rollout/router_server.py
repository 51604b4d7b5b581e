"""gRPC glue for the router: proto <-> plain objects around ``RouterCore``.

The router serves ``rlfleet.v1.Rollout`` so a client can talk to it exactly like to one
replica, but only ``Generate`` makes sense fleet-wide; control RPCs (weights, cache, pause)
target one engine and must go to each replica directly, so here they answer UNIMPLEMENTED.
"""

from __future__ import annotations

from services.common.grpc_server import Registration
from services.common.proto.rlfleet.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.rollout.router import ReplicaView, RouterCore
from services.rollout.types import Completion, GenerateRequest, GenerateResult, SamplingParams

DIRECT_ONLY = (
    "the router only routes Generate; call {} on each replica directly "
    "(addresses from Router.ListReplicas)"
)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto3 zeros mean 'unset': n and max_tokens fall back to defaults, top_p 0 means 1."""
    defaults = SamplingParams()
    return SamplingParams(
        n=msg.n or defaults.n,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=max(0, msg.top_k),
        max_tokens=msg.max_tokens or defaults.max_tokens,
        stop=list(msg.stop),
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs,
    )


def request_from_proto(msg: rollout_pb2.GenerateRequest) -> GenerateRequest:
    which = msg.WhichOneof("prompt")
    return GenerateRequest(
        request_id=msg.request_id,
        sampling=sampling_from_proto(msg.sampling),
        prompt_token_ids=list(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        prompt_text=msg.prompt_text if which == "prompt_text" else None,
        session_id=msg.session_id,
        min_weight_version=msg.min_weight_version,
        timeout_s=msg.timeout_s,
    )


def completion_to_proto(completion: Completion) -> common_pb2.Completion:
    return common_pb2.Completion(
        token_ids=completion.token_ids,
        logprobs=completion.logprobs,
        text=completion.text,
        finish_reason=completion.finish_reason,
    )


def response_to_proto(result: GenerateResult) -> rollout_pb2.GenerateResponse:
    return rollout_pb2.GenerateResponse(
        request_id=result.request_id,
        completions=[completion_to_proto(c) for c in result.completions],
        weight_version=result.weight_version,
        replica_id=result.replica_id,
        prompt_token_ids=result.prompt_token_ids,
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
        return response_to_proto(await self._core.generate(request_from_proto(request)))

    async def UpdateWeights(self, request_iterator, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("UpdateWeights"))

    async def FlushCache(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("FlushCache"))

    async def Pause(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("Pause"))

    async def Resume(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("Resume"))

    async def GetStatus(self, request, context):  # noqa: N802
        raise NotImplementedError(DIRECT_ONLY.format("GetStatus (or Router.ListReplicas)"))


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
