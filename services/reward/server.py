"""gRPC glue for the reward service: proto <-> plain objects, and nothing else.

``Struct`` holds only doubles, so integral numbers in ``extra_info`` come back as ints
(``{"index": 3}`` stays 3, not 3.0): user functions written for verl index lists with them.
The client half (``*_to_proto``/``*_from_proto`` for the other direction, ``error_from_rpc``)
lives here too, so no other reward module imports grpc.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from rlfleet.common import errors
from rlfleet.common.grpc_server import Registration
from rlfleet.proto import common_pb2, reward_pb2, reward_pb2_grpc
from rlfleet.reward.service import RewardService
from rlfleet.reward.types import ScoreRequest, ScoreResult, ScorerInfo

SERVICE_NAME = "rlfleet.v1.Reward"
RpcError = grpc.aio.AioRpcError
_MAX_EXACT_INT = 2**53


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """Each RPC: proto -> plain objects -> RewardService -> proto."""

    def __init__(self, service: RewardService) -> None:
        self._service = service

    async def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResult:
        return result_to_proto(await self._service.score(request_from_proto(request)))

    async def ScoreBatch(
        self, request: reward_pb2.ScoreBatchRequest, context: Any
    ) -> reward_pb2.ScoreBatchResponse:
        items = [request_from_proto(item) for item in request.requests]
        results = await self._service.score_batch(items)
        return reward_pb2.ScoreBatchResponse(results=[result_to_proto(r) for r in results])

    async def ListScorers(
        self, request: common_pb2.Empty, context: Any
    ) -> reward_pb2.ListScorersResponse:
        infos = [scorer_info_to_proto(info) for info in self._service.list_scorers()]
        return reward_pb2.ListScorersResponse(scorers=infos)


def registration(service: RewardService) -> Registration:
    return Registration(
        reward_pb2_grpc.add_RewardServicer_to_server, RewardServicer(service), SERVICE_NAME
    )


# ---- conversions ----------------------------------------------------------------------


def request_from_proto(msg: reward_pb2.ScoreRequest) -> ScoreRequest:
    return ScoreRequest(
        id=msg.id,
        data_source=msg.data_source,
        solution_str=msg.solution_str,
        ground_truth=msg.ground_truth,
        extra_info=struct_to_dict(msg.extra_info),
        scorer=msg.scorer if msg.HasField("scorer") else None,
    )


def request_to_proto(request: ScoreRequest) -> reward_pb2.ScoreRequest:
    msg = reward_pb2.ScoreRequest(
        id=request.id,
        data_source=request.data_source,
        solution_str=request.solution_str,
        ground_truth=request.ground_truth,
    )
    if request.extra_info:
        try:
            msg.extra_info.update(request.extra_info)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"extra_info of {request.id!r}: {exc}") from exc
    if request.scorer:
        msg.scorer = request.scorer
    return msg


def result_to_proto(result: ScoreResult) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        id=result.id, score=result.score, metrics=result.metrics, error=result.error
    )


def result_from_proto(msg: reward_pb2.ScoreResult) -> ScoreResult:
    return ScoreResult(id=msg.id, score=msg.score, metrics=dict(msg.metrics), error=msg.error)


def scorer_info_to_proto(info: ScorerInfo) -> reward_pb2.ScorerInfo:
    return reward_pb2.ScorerInfo(
        name=info.name,
        kind=info.kind,
        data_sources=info.data_sources,
        description=info.description,
    )


def scorer_info_from_proto(msg: reward_pb2.ScorerInfo) -> ScorerInfo:
    return ScorerInfo(msg.name, msg.kind, list(msg.data_sources), msg.description)


def struct_to_dict(struct: struct_pb2.Struct) -> dict[str, Any]:
    return _restore_ints(json_format.MessageToDict(struct))


def _restore_ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _restore_ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_restore_ints(item) for item in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < _MAX_EXACT_INT:
        return int(value)
    return value


# ---- client side ----------------------------------------------------------------------

_ERROR_BY_STATUS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
    grpc.StatusCode.DEADLINE_EXCEEDED: TimeoutError,
}


def error_from_rpc(exc: grpc.aio.AioRpcError) -> Exception:
    """The rlfleet exception a failed call stands for (RuntimeError for unexpected codes)."""
    error_type = _ERROR_BY_STATUS.get(exc.code(), RuntimeError)
    return error_type(f"reward {exc.code().name}: {exc.details()}")


def empty() -> common_pb2.Empty:
    return common_pb2.Empty()
