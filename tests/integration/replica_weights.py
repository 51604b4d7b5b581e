"""A trainer's weights for a real replica process in tests: the tiny model's own tensors and the
trainer's push path (``WeightSync`` over ``GrpcWeightTransport``) aimed at one replica.

Why here: the weight tests (``test_weight_updates``, ``test_fetch_before_pause``,
``test_rollout_replica``) each push to one replica as the trainer does; written once, they
cannot drift apart in how that replica is listed or how the transport is set up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch
from replica_proc import MODEL
from safetensors.torch import load_file

from rlfleet.rollout.client import PreparedUpdate, RolloutClient
from rlfleet.rollout.types import ReplicaStatus
from rlfleet.trainer.weight_sync import ReplicaDirectory, WeightSync
from rlfleet.trainer.weight_transport import DeltaMode, GrpcWeightTransport

CHUNK_BYTES = 4 * 2**20


def original_weights() -> dict[str, torch.Tensor]:
    """The tiny model's weights as its checkpoint holds them (a fresh copy each call)."""
    return load_file(str(MODEL / "model.safetensors"))


class OneReplica(ReplicaDirectory):
    """A ``ReplicaDirectory`` that lists one replica, asked over gRPC (as a router would)."""

    def __init__(self, address: str) -> None:
        self._client = RolloutClient(address)

    async def list_replicas(self) -> list[ReplicaStatus]:
        return [await self._client.status()]

    async def close(self) -> None:
        await self._client.close()


def replica_transport(
    chunk_bytes: int = CHUNK_BYTES, delta: DeltaMode = "never", shared_memory: bool = False
) -> GrpcWeightTransport:
    """The trainer's gRPC transport (``delta``: ``trainer.weight_delta``)."""
    transport = GrpcWeightTransport(
        RolloutClient, PreparedUpdate.of, chunk_bytes, shared_memory=shared_memory
    )
    transport.delta = delta
    return transport


@asynccontextmanager
async def one_replica_sync(
    address: str, chunk_bytes: int = CHUNK_BYTES, delta: DeltaMode = "never"
) -> AsyncIterator[WeightSync]:
    """The trainer's ``WeightSync`` pushing to the one replica at ``address``; closed after."""
    sync = WeightSync(OneReplica(address), replica_transport(chunk_bytes, delta))
    try:
        yield sync
    finally:
        await sync.close()
