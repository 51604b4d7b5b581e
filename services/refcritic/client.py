"""Async client for the refcritic, on plain lists (conversions in ``convert``).

Failed calls raise the matching ``rlfleet.common.errors`` exception with the gRPC error as its
``__cause__`` (``InvalidArgument`` for a bad batch, ``FailedPrecondition`` when the critic is
disabled, ``NotFound`` for a missing checkpoint); UNAVAILABLE is retried by the channel.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.common.grpc_client import ServiceClient
from rlfleet.proto import refcritic_pb2, refcritic_pb2_grpc
from rlfleet.refcritic.convert import rows_from_proto, rows_to_proto, sequences_to_proto


@dataclass
class CheckpointInfo:
    """Where the critic checkpoint is (absolute, on the refcritic's machine) and its step."""

    path: str
    step: int


class RefCriticClient(ServiceClient):
    """One channel to a refcritic; every method is one RPC with a deadline of ``timeout_s``."""

    SERVICE = "refcritic"

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        max_message_mb: int = 64,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(address, api_key, timeout_s, max_message_mb)
        self._stub = refcritic_pb2_grpc.RefCriticStub(self._channel)
        self.critic_step = 0
        """Critic optimizer steps reported by the last update/save/load."""

    async def ref_logprobs(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]:
        """Reference log-prob of every response token, one list per sequence."""
        reply = await self._call(
            self._stub.ComputeRefLogProbs, sequences_to_proto(prompts, responses)
        )
        return rows_from_proto(reply)

    async def values(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]:
        """Critic value of the state before every response token, one list per sequence."""
        reply = await self._call(self._stub.ComputeValues, sequences_to_proto(prompts, responses))
        return rows_from_proto(reply)

    async def update_critic(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        returns: list[list[float]],
        old_values: list[list[float]],
        epochs: int = 0,
        micro_batch_size: int = 0,
    ) -> dict[str, float]:
        """One critic update (0 = the server's default); verl-named metrics (critic/vf_loss, ...)."""
        request = refcritic_pb2.CriticUpdateRequest(
            batch=sequences_to_proto(prompts, responses),
            returns=rows_to_proto(returns),
            old_values=rows_to_proto(old_values),
            epochs=epochs,
            micro_batch_size=micro_batch_size,
        )
        reply = await self._call(self._stub.UpdateCritic, request)
        self.critic_step = reply.step
        return dict(reply.metrics)

    async def save_checkpoint(self, path: str) -> CheckpointInfo:
        reply = await self._call(
            self._stub.SaveCheckpoint, refcritic_pb2.CheckpointRequest(path=path)
        )
        self.critic_step = reply.step
        return CheckpointInfo(reply.path, reply.step)

    async def load_checkpoint(self, path: str) -> CheckpointInfo:
        reply = await self._call(
            self._stub.LoadCheckpoint, refcritic_pb2.CheckpointRequest(path=path)
        )
        self.critic_step = reply.step
        return CheckpointInfo(reply.path, reply.step)
