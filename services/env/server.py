"""gRPC glue for the env service: each RPC is proto -> plain objects -> EnvService -> proto.

The conversions live in ``convert`` (shared with the client); errors are plain
``rlfleet.common.errors`` exceptions that ``GrpcServer``'s interceptor maps to status codes
(a bad field is INVALID_ARGUMENT naming it).
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.grpc_server import Registration
from rlfleet.env.convert import info_to_proto, outcome_to_proto, request_from_proto
from rlfleet.env.service import EnvService
from rlfleet.proto import common_pb2, env_pb2, env_pb2_grpc

SERVICE_NAME = "rlfleet.v1.Env"


class EnvServicer(env_pb2_grpc.EnvServicer):
    """Each RPC: proto -> plain objects -> EnvService -> proto."""

    def __init__(self, service: EnvService) -> None:
        self._service = service

    async def RunEpisodes(
        self, request: env_pb2.RunEpisodesRequest, context: Any
    ) -> env_pb2.RunEpisodesResponse:
        outcomes = await self._service.run_episodes(*request_from_proto(request))
        return env_pb2.RunEpisodesResponse(results=[outcome_to_proto(o) for o in outcomes])

    async def ListEnvironments(
        self, request: common_pb2.Empty, context: Any
    ) -> env_pb2.ListEnvironmentsResponse:
        infos = [info_to_proto(info) for info in self._service.list_environments()]
        return env_pb2.ListEnvironmentsResponse(environments=infos)


def registration(service: EnvService) -> Registration:
    return Registration(env_pb2_grpc.add_EnvServicer_to_server, EnvServicer(service), SERVICE_NAME)
