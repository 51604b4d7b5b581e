"""The refcritic's gRPC surface (service ``rlfleet.v1.RefCritic``): proto <-> RefPolicy / Critic.

Why a thread and a lock: a forward or an optimizer step takes from milliseconds to seconds, and
running it on the event loop would starve health checks (the fleet would think the service
dead). Each call runs in a worker thread; a ``threading.Lock`` taken *inside* that thread keeps
one model computation at a time (the models are not thread-safe, and torch already uses every
thread it was given), and stays held until the work really ends even if the caller gives up.

With ``redis_url`` set, the stateless reads (ComputeRefLogProbs, ComputeValues) go through
``rlfleet.refcritic.queue_service``: computed in this process when its worker is idle, else
answered by queue workers, so more processes add reference throughput and a dead worker's job
is reclaimed. Either way the model validates the sequences, once (not here as well).
UpdateCritic, SaveCheckpoint and LoadCheckpoint always run directly in this process: the
critic's weights and optimizer state must have exactly one writer. Without ``redis_url`` every
call is computed directly here (one process, no Redis needed).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.common.grpc_server import GrpcServer, Registration
from rlfleet.proto import common_pb2, refcritic_pb2, refcritic_pb2_grpc
from rlfleet.refcritic.convert import rows_from_proto, rows_to_proto, sequences_from_proto
from rlfleet.refcritic.models import CriticModel, Models, ReferenceModel, Rows

if TYPE_CHECKING:
    from rlfleet.refcritic.queue_service import Kind, QueuedCompute

log = logging.getLogger(__name__)

SERVICE_NAME = "rlfleet.v1.RefCritic"
T = TypeVar("T")


class RefCriticServicer(refcritic_pb2_grpc.RefCriticServicer):
    """Thin: unpack the request, run the core in a thread, pack the answer."""

    def __init__(
        self,
        reference: ReferenceModel,
        critic: CriticModel | None,
        lock: threading.Lock | None = None,
        queued: QueuedCompute | None = None,
    ) -> None:
        self._reference = reference
        self._critic = critic
        self._lock = lock or threading.Lock()
        self._queued = queued
        """A QueuedCompute for the queue path; None computes reads directly."""

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        def locked() -> T:
            with self._lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    def _require_critic(self) -> CriticModel:
        if self._critic is None:
            raise FailedPrecondition("the critic is disabled (refcritic.critic_enabled=false)")
        return self._critic

    async def _read(
        self,
        kind: Kind,
        compute: Callable[[list[list[int]], list[list[int]]], Rows],
        request: refcritic_pb2.SequenceBatch,
    ) -> common_pb2.FloatRows:
        """Rows through the queue path (local first) or computed directly."""
        prompts, responses = sequences_from_proto(request)
        if self._queued is None:
            return rows_to_proto(await self._run(compute, prompts, responses))
        return rows_to_proto(await self._queued.compute(kind, prompts, responses))

    async def ComputeRefLogProbs(self, request, context):
        return await self._read("ref", self._reference.logprobs, request)

    async def ComputeValues(self, request, context):
        return await self._read("values", self._require_critic().values, request)

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


def build_server(config: RlfleetConfig, servicer: RefCriticServicer) -> GrpcServer:
    registration = Registration(
        refcritic_pb2_grpc.add_RefCriticServicer_to_server, servicer, SERVICE_NAME
    )
    settings = config.refcritic
    return GrpcServer(
        [registration], settings.host, settings.port, config.max_message_mb, config.api_key
    )


async def start_server(
    config: RlfleetConfig, models: Models, lock: threading.Lock, queued: QueuedCompute | None
) -> GrpcServer:
    """Serve ``models`` (reference, critic); health turns SERVING once this returns."""
    servicer = RefCriticServicer(models.reference, models.critic, lock, queued)
    server = build_server(config, servicer)
    await server.start()
    return server
