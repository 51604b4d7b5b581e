"""gRPC glue for the reward service: each RPC is proto -> plain objects -> RewardService ->
proto. The conversions live in ``convert`` (shared with the client); errors are plain
``rlfleet.common.errors`` exceptions that ``GrpcServer``'s interceptor maps to status codes.
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.grpc_server import Registration
from rlfleet.proto import common_pb2, reward_pb2, reward_pb2_grpc
from rlfleet.reward.convert import request_from_proto, result_to_proto, scorer_info_to_proto
from rlfleet.reward.service import RewardService

SERVICE_NAME = "rlfleet.v1.Reward"


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
