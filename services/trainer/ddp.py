"""The data-parallel actor (``trainer.strategy: ddp``): a full replica per rank, torch DDP.

Each Ray worker (``rlfleet.trainer.ranks``: placement group, rendezvous, the batch split and
the weight fetch) holds a full replica of the policy and its optimizer, and its update runs
through ``DistributedDataParallel``, whose gradient all-reduce leaves every replica the same
gradients, so the replicas stay equal and rank 0 alone answers for the weights and the
optimizer state. ``trainer.strategy: fsdp`` (``rlfleet.trainer.fsdp``) shards them instead.
"""

from __future__ import annotations

from rlfleet.common.config import RlfleetConfig
from rlfleet.trainer.ranks import RankedActor, RankWorker


def parallel_actor(config: RlfleetConfig, model, pad_id: int) -> RankedActor:
    """The actor ``trainer.strategy`` names, for strategies other than ``single``."""
    strategy = config.trainer.strategy
    if strategy == "fsdp":
        from rlfleet.trainer.fsdp import FSDPActor

        return FSDPActor(config, model, pad_id)
    if strategy != "ddp":
        raise ValueError(f"parallel_actor needs strategy ddp or fsdp, got {strategy!r}")
    return DDPActor(config, model, pad_id)


class DDPWorker(RankWorker):
    """A Ray actor holding one rank: its model replica, optimizer and process-group member."""

    def wrap(self, on_gpu: bool):
        """The module the update's forward and backward run through: a DDP wrapper."""
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (rotary tables) are equal and constant: synced once at init, not per forward.
        return DistributedDataParallel(
            self.model, device_ids=[0] if on_gpu else None, forward_sync_buffers=False
        )


class DDPActor(RankedActor):
    """The ``Actor`` interface over DDP ranks."""

    worker = DDPWorker
