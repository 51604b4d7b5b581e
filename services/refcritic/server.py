"""The refcritic's gRPC surface (service ``rlfleet.v1.RefCritic``): proto <-> RefPolicy / Critic.

Why a thread and a lock: a forward or an optimizer step takes from milliseconds to seconds, and
running it on the event loop would starve health checks (the fleet would think the service
dead). Each call runs in a worker thread; a ``threading.Lock`` taken *inside* that thread keeps
one model computation at a time (the models are not thread-safe, and torch already uses every
thread it was given), and stays held until the work really ends even if the caller gives up.

Requests arrive directly over gRPC. Taking work from a Redis stream (``services.common.
workqueue``), so several refcritic processes can share a backlog, is future work; one process per
fleet is enough for the default job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from services.common.config import RlfleetConfig
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.grpc_server import GrpcServer, Registration, install_stop_signals
from services.common.proto.rlfleet.v1 import refcritic_pb2, refcritic_pb2_grpc
from services.refcritic.client import rows_from_proto, rows_to_proto

log = logging.getLogger(__name__)

SERVICE_NAME = "rlfleet.v1.RefCritic"


def sequences_from_proto(batch: refcritic_pb2.SequenceBatch):
    """(prompts, responses) as plain lists of token ids."""
    prompts = [list(s.prompt_token_ids) for s in batch.sequences]
    return prompts, [list(s.response_token_ids) for s in batch.sequences]


class RefCriticServicer(refcritic_pb2_grpc.RefCriticServicer):
    """Thin: unpack the request, run the core in a thread, pack the answer."""

    def __init__(self, reference: Any, critic: Any | None) -> None:
        self._reference = reference
        self._critic = critic
        self._lock = threading.Lock()

    async def _run(self, fn: Callable, *args: Any) -> Any:
        def locked() -> Any:
            with self._lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    def _require_critic(self) -> Any:
        if self._critic is None:
            raise FailedPrecondition("the critic is disabled (refcritic.critic_enabled=false)")
        return self._critic

    async def ComputeRefLogProbs(self, request, context):
        rows = await self._run(self._reference.logprobs, *sequences_from_proto(request))
        return rows_to_proto(rows)

    async def ComputeValues(self, request, context):
        critic = self._require_critic()
        return rows_to_proto(await self._run(critic.values, *sequences_from_proto(request)))

    async def UpdateCritic(self, request, context):
        critic = self._require_critic()
        prompts, responses = sequences_from_proto(request.batch)
        returns, old_values = rows_from_proto(request.returns), rows_from_proto(request.old_values)
        metrics = await self._run(
            critic.update,
            prompts,
            responses,
            returns,
            old_values,
            request.epochs or None,
            request.micro_batch_size or None,
        )
        return refcritic_pb2.CriticUpdateResponse(metrics=metrics, step=critic.step)

    async def SaveCheckpoint(self, request, context):
        critic = self._require_critic()
        path = await self._run(critic.save, _required_path(request.path))
        return refcritic_pb2.CheckpointResponse(path=path, step=critic.step)

    async def LoadCheckpoint(self, request, context):
        critic = self._require_critic()
        path = await self._run(critic.load, _required_path(request.path))
        return refcritic_pb2.CheckpointResponse(path=path, step=critic.step)


def _required_path(path: str) -> str:
    if not path:
        raise InvalidArgument("a checkpoint path is required")
    return path


def build_servicer(config: RlfleetConfig) -> RefCriticServicer:
    """Load the reference (always) and the critic (if enabled); this is the slow part."""
    from services.refcritic.critic import Critic
    from services.refcritic.reference import RefPolicy

    reference = RefPolicy(config)
    critic = Critic(config) if config.refcritic.critic_enabled else None
    return RefCriticServicer(reference, critic)


def build_server(config: RlfleetConfig, servicer: RefCriticServicer) -> GrpcServer:
    registration = Registration(
        refcritic_pb2_grpc.add_RefCriticServicer_to_server, servicer, SERVICE_NAME
    )
    settings = config.refcritic
    return GrpcServer(
        [registration], settings.host, settings.port, config.max_message_mb, config.api_key
    )


async def serve(config: RlfleetConfig) -> None:
    """Load the models, then serve until SIGTERM/SIGINT (health is SERVING only once loaded)."""
    servicer = await asyncio.to_thread(build_servicer, config)
    server = build_server(config, servicer)
    await server.start()
    stop = asyncio.Event()
    install_stop_signals(stop)
    await stop.wait()
    log.info("refcritic stopping")
    await server.stop()
