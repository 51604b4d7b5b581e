"""The sharded data-parallel actor (``trainer.strategy: fsdp``): FSDP2 on Ray workers.

The same machinery as ``trainer.strategy: ddp`` (``rlfleet.trainer.ranks``: one Ray worker
per rank in a placement group, the batch shipped once, every rank walking the same mini-batches
and training its shard of the kept rows, scaled by its share of the loss denominator times the
world size), with the model
sharded by ``torch.distributed.fsdp.fully_shard`` (FSDP2) instead of replicated: each decoder
layer and then the whole model become one FSDP unit, so a rank holds 1/world_size of every
parameter and of the AdamW state (DTensors sharded on dim 0), all-gathers a layer's weights
for its forward and backward, and reduce-scatters the gradients (their mean over the ranks,
as DDP's all-reduce). Gloo on CPU, NCCL when each worker has a GPU; float32 throughout (no
mixed-precision policy), so one update equals the single actor's to float32 rounding.

What sharding changes, because every collective needs every rank:
- a forward all-gathers weights, so every rank runs the same number of forwards: the ranks'
  actors take the single forward (``share_prompt_forward`` off: the shared-prompt path runs one
  or two forwards depending on the rows), and a rank given no rows for log-probs runs one
  dummy row;
- the weights for a push and the optimizer state for a checkpoint are gathered by every rank
  at once (``DTensor.full_tensor``); rank 0 returns them, in the single actor's names, shapes
  and format (a checkpoint moves between ``single``, ``ddp`` and ``fsdp``);
- loading a checkpoint gives every rank the full optimizer state; each keeps its own shard.
"""

from __future__ import annotations

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.trainer.ranks import RankedActor, RankWorker, on_cpu, parameter_blobs


def full_tensor(value):
    """``value`` whole: a DTensor's all-gathered full tensor (a collective), else itself."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def local_part(value):
    """This rank's shard of a DTensor (a plain tensor: itself)."""
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def shard_like(value, param):
    """Full tensor ``value`` (every rank holds it) as a DTensor laid out like ``param``, each
    rank keeping its own shard (no communication); non-DTensor ``param``: ``value`` as is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if value.shape != param.shape:  # a scalar like Adam's step stays a plain tensor
        return value
    value = value.to(param.device)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


class FSDPWorker(RankWorker):
    """A Ray actor holding one rank: its shard of the policy and of the optimizer."""

    def wrap(self, on_gpu: bool):
        """Shard every decoder layer, then the rest (embeddings, tied head, final norm)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = torch.distributed.get_world_size()
        mesh = init_device_mesh("cuda" if on_gpu else "cpu", (world,))
        for layer in decoder_layers(self.model):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        return self.model  # sharded in place: the same module, the same parameter names

    def rank_config(self) -> RlfleetConfig:
        """The single forward per mini-batch (see the module docstring)."""
        trainer = self.config.trainer.model_copy(update={"share_prompt_forward": False})
        return self.config.model_copy(update={"trainer": trainer})

    def logprobs(self, prompts, responses) -> list[list[float]]:
        """This rank's rows' log-probs; with none, one dummy row (the others' all-gathers need
        this rank's part)."""
        if prompts:
            return super().logprobs(prompts, responses)
        self.actor.logprobs([[self.pad_id]], [[self.pad_id]])
        return []

    def parameters(self):
        """Every rank gathers (a collective); rank 0 returns the blobs, the others ``None``."""
        full = [(name, full_tensor(p.detach())) for name, p in self.model.named_parameters()]
        return parameter_blobs(full) if self.rank == 0 else None

    def shard_numel(self) -> int:
        """How many parameter elements this rank holds (about 1/world_size of the model's)."""
        return sum(local_part(p).numel() for p in self.model.parameters())

    def gradients(self) -> dict[str, torch.Tensor]:
        """The full gradients (every rank gathers; each returns them)."""
        grads = self.model.named_parameters()
        return {name: full_tensor(p.grad.detach()).cpu().clone() for name, p in grads}

    def training_state(self) -> dict | None:
        """The single actor's optimizer/schedule format, whole, from rank 0 (a collective)."""
        state = self.actor.training_state()
        optimizer = state["optimizer"]
        gathered = {
            index: {key: full_tensor(value) for key, value in per_param.items()}
            for index, per_param in optimizer["state"].items()
        }
        state["optimizer"] = {**optimizer, "state": gathered}
        return on_cpu(state) if self.rank == 0 else None

    def apply_training_state(self, state: dict) -> None:
        params = list(self.actor.trainable)  # the optimizer's indices, in order
        optimizer = state["optimizer"]
        sharded = {
            index: {key: shard_like(value, params[index]) for key, value in per_param.items()}
            for index, per_param in optimizer["state"].items()
        }
        super().apply_training_state({**state, "optimizer": {**optimizer, "state": sharded}})


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (``model.model.layers`` for Qwen2 and
    Llama-like models): the FSDP units below the root."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise NotImplementedError(
            f"trainer.strategy: fsdp knows where the decoder layers are for models with "
            f"model.layers (Qwen2, Llama); {type(model).__name__} has none"
        )
    return list(layers)


class FSDPActor(RankedActor):
    """The ``Actor`` interface over FSDP2 ranks (see the module docstring)."""

    worker = FSDPWorker
    every_rank_forwards = True

    def from_rank0(self, method: str):
        """Rank 0's answer to ``method``, asked of every rank (gathering is a collective)."""
        return self.group.call(method)[0]
