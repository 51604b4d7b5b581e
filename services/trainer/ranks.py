"""The data-parallel actors' machinery: forward and backward on ``trainer.world_size`` workers.

``RankedActor`` has the single-process ``Actor``'s interface, so the controller loop does not
change; a strategy (``rlfleet.trainer.ddp``: a DDP replica per rank, ``rlfleet.trainer.fsdp``:
an FSDP2 shard per rank) subclasses it and ``RankWorker`` and says how a rank's model is
wrapped. Each worker holds an ``Actor`` whose update runs through that wrapper: gloo on CPU,
NCCL when each worker has a GPU. The workers sit in one placement group, one bundle per rank;
rank 0 picks the rendezvous address, and every rank gets ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` before ``init_process_group``.

One update, as the single actor does it, on every rank at once: the controller draws the row
order of each epoch (its RNG, the one checkpoints save) and ships the batch once through the
object store; every rank walks the same mini-batches and drops the same zero-advantage rows,
then trains a contiguous shard of the kept rows, in micro-batches of at most
``trainer.ppo_micro_batch_size`` rows (the single actor's ``backward_groups``). Each
micro-batch's loss is aggregated over its rows and scaled by its share of the whole
mini-batch's loss denominator (``loss_denominator``) times the world size, so the ranks'
gradient mean is the whole mini-batch's gradient; gradient clipping and the optimizer step
then run on identical gradients and the ranks stay equal. Every rank runs as many micro-batches
as the largest shard needs, a rank with fewer rows (or none) running a row with weight 0 for
each missing one, because the collectives need a forward and a backward from every rank.
Metrics are reduced from each part's share of them (``MetricSums``: losses by the share of the
loss denominator, token means by the share of tokens, so both are exact; ``/max`` metrics take
the maximum).

Weights go out from rank 0. The controller's push reads ``state_dict_for_rollout()``: the first
call after an update fetches rank 0's parameters once, as raw bytes per tensor, written by rank
0 into the object store (one copy; on a GPU the device-to-host copy is that copy) and read by
the controller in place (zero-copy views of the shared-memory buffers, no second copy). They are
kept until the next update, so the sync loop's per-step ``only_stale`` check and the push of the
same version fetch nothing more. The controller's own module (``model``) is refreshed from them
only when asked for (checkpoints, tests).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.trainer.actor import (
    Actor,
    epoch_orders,
    map_row_groups,
    micro_batch_count,
    read_training_state,
    split_bounds,
    write_training_state,
)

log = logging.getLogger(__name__)


# --- what travels to the workers -------------------------------------------------------------
@dataclass
class UpdateRows:
    """The per-sequence inputs of an update (``RolloutBatch``'s fields the actor reads)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    old_logprobs: list[list[float]]
    ref_logprobs: list[list[float]]
    behaviour_logprobs: list[list[float]]
    rollout_logprobs: list[list[float]]
    rollout_is_weights: list[list[float]]

    @classmethod
    def of(cls, batch) -> UpdateRows:
        return cls(*(getattr(batch, column.name) for column in fields(cls)))

    def __len__(self) -> int:
        return len(self.responses)


shard_bounds = split_bounds
"""``[lo, hi)`` of rank ``rank``'s contiguous share of ``rows`` (sizes differ by <= 1)."""


def parameter_blobs(named) -> list[tuple[str, str, tuple[int, ...], object]]:
    """``(name, dtype, shape, raw bytes as a uint8 numpy array)`` per ``(name, tensor)`` of
    ``named`` (a model's ``named_parameters()``); on the CPU the arrays are views of the tensors
    (no copy here; Ray copies them into the object store)."""
    blobs = []
    for name, param in named:
        flat = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        dtype = str(param.dtype).removeprefix("torch.")
        blobs.append((name, dtype, tuple(param.shape), flat.numpy()))
    return blobs


def tensors_from_blobs(blobs) -> dict[str, torch.Tensor]:
    """Tensors viewing ``parameter_blobs``' arrays in place (read-only object-store memory:
    the weight push only reads them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return {
            name: torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, raw in blobs
        }


def on_cpu(state):
    """``state`` (nested dicts/lists of tensors and plain values) with every tensor on the CPU."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {key: on_cpu(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(on_cpu(value) for value in state)
    return state


# --- one rank ----------------------------------------------------------------------------------
class ShardedActor(Actor):
    """One rank's actor: walks every mini-batch, trains its shard of the kept rows."""

    def __init__(self, config: RlfleetConfig, model, pad_id: int, train_module, rank: int) -> None:
        super().__init__(config, model, pad_id)
        self.train_module = train_module
        self.rank = rank
        self.world_size = torch.distributed.get_world_size()

    def _backward(self, batch, idx, adv, mask, rows, scale: float) -> dict[str, float]:
        """This rank's shard of rows ``idx``, in as many micro-batches as the largest shard
        needs (every rank runs the same number of forwards and backwards: the collectives
        need them all; a rank with fewer rows runs empty micro-batches as one weight-0 row)."""
        lo, hi = shard_bounds(len(idx), self.rank, self.world_size)
        widest = math.ceil(len(idx) / self.world_size)
        count = micro_batch_count(widest, self.cfg.ppo_micro_batch_size)
        groups = self.micro_batch_groups(batch, idx, range(lo, hi), count)
        # DDP and FSDP average over ranks: times world_size, the sum of the shards' gradients.
        weight = scale * self.world_size
        return self._reduce_metrics(
            self.backward_groups(batch, idx, adv, mask, rows, groups, weight)
        )

    def _reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The whole mini-batch's metrics from the ranks' shares of them (``MetricSums``):
        sums, and maxima of ``/max`` ones (an empty shard's are -inf)."""
        names = sorted(metrics)
        peaks = [name for name in names if name.endswith("/max")]
        means = [name for name in names if not name.endswith("/max")]
        dist = torch.distributed
        wide = {"dtype": torch.float64, "device": self.device}
        sums = torch.tensor([metrics[n] for n in means], **wide)
        dist.all_reduce(sums)
        reduced = dict(zip(means, sums.tolist(), strict=True))
        if peaks:
            highs = torch.tensor([metrics[n] for n in peaks], **wide)
            dist.all_reduce(highs, op=dist.ReduceOp.MAX)
            reduced.update(zip(peaks, highs.tolist(), strict=True))
        return reduced


class RankWorker:
    """A Ray actor holding one rank: its model (a replica or a shard), optimizer and
    process-group member. A strategy's subclass says how the model is wrapped (``wrap``)."""

    def __init__(self, config: RlfleetConfig, model, pad_id: int, rank: int) -> None:
        torch.set_num_threads(config.trainer.torch_threads)
        self.config = config
        self.model = model
        self.pad_id = pad_id
        self.rank = rank

    actor: ShardedActor
    """This rank's actor, made by ``join`` (the process group must exist first)."""

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0)."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, world_size: int, master: tuple[str, int], backend: str) -> None:
        """Join the process group (every rank at once) and wrap the model (``wrap``)."""
        os.environ.update(
            WORLD_SIZE=str(world_size),
            RANK=str(self.rank),
            LOCAL_RANK="0",  # Ray shows each worker only its own GPU
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        torch.distributed.init_process_group(backend, init_method="env://")
        on_gpu = backend == "nccl"
        if on_gpu:
            self.model = self.model.to("cuda:0")
        train_module = self.wrap(on_gpu)
        self.actor = ShardedActor(
            self.rank_config(), self.model, self.pad_id, train_module, self.rank
        )

    def wrap(self, on_gpu: bool):
        """The module the update's forward and backward run through (the strategy's)."""
        raise NotImplementedError(f"{type(self).__name__} does not say how to wrap the model")

    def rank_config(self) -> RlfleetConfig:
        """The config this rank's actor runs with (the trainer's, here)."""
        return self.config

    def update(self, payload) -> tuple[dict[str, float], int]:
        rows, advantages, mask, orders = payload
        metrics = self.actor.update(rows, advantages, mask, orders)
        return metrics, self.actor.updates

    def logprobs(self, prompts, responses) -> list[list[float]]:
        return self.actor.logprobs(prompts, responses)

    def parameters(self):
        return parameter_blobs(self.model.named_parameters())

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's gradients after the last optimizer step (for tests and debugging)."""
        return {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def training_state(self) -> dict | None:
        """Optimizer/schedule state, on the CPU (the controller may have no GPU); None from a
        rank that does not hold it whole (FSDP's ranks other than 0)."""
        return on_cpu(self.actor.training_state())

    def apply_training_state(self, state: dict) -> None:
        self.actor.apply_training_state(state)

    def leave(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# --- the ranks ---------------------------------------------------------------------------------
class RankGroup:
    """``world_size`` ``worker`` (a ``RankWorker`` subclass) actors in one placement group,
    joined in a process group."""

    def __init__(self, config: RlfleetConfig, model, pad_id: int, worker: type) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = config.trainer
        self.cluster = None
        if not ray.is_initialized():  # a trainer outside Ray: join ray.address or start one
            from rlfleet.common.ray_cluster import connect

            cpus = max(cfg.world_size, os.cpu_count() or 1)
            self.cluster = connect(config.ray, None, cpus)
        gpus = cfg.worker_gpus
        bundle = {"CPU": 1.0, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([dict(bundle) for _ in range(cfg.world_size)], "PACK")
        timeout = config.ray.start_timeout_s
        if not ray.wait([self.group.ready()], timeout=timeout)[0]:
            ray.util.remove_placement_group(self.group)
            raise RuntimeError(
                f"the Ray cluster cannot place {cfg.world_size} actor workers of {bundle} "
                f"within {timeout:.0f} s (trainer.world_size, trainer.worker_gpus); it has "
                f"{ray.cluster_resources()}"
            )
        remote = ray.remote(worker)
        model_ref = ray.put(model)
        self.workers = [
            remote.options(
                num_cpus=1,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, rank),
            ).remote(config, model_ref, pad_id, rank)
            for rank in range(cfg.world_size)
        ]
        del model_ref
        master = ray.get(self.workers[0].rendezvous_address.remote())
        backend = "nccl" if gpus else "gloo"
        ray.get([w.join.remote(cfg.world_size, master, backend) for w in self.workers])
        log.info("%s actor: %d ranks (%s) at %s:%d", cfg.strategy, cfg.world_size, backend, *master)

    def call(self, method: str, *args) -> list:
        """``method(*args)`` on every rank; the results in rank order."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def call_rank0(self, method: str, *args):
        import ray

        return ray.get(getattr(self.workers[0], method).remote(*args))

    def close(self) -> None:
        import ray

        try:
            self.call("leave")
        finally:
            for worker in self.workers:
                ray.kill(worker)
            ray.util.remove_placement_group(self.group)
            if self.cluster is not None:
                self.cluster.shutdown()


# --- the controller's side ---------------------------------------------------------------------
class RankedActor:
    """The ``Actor`` interface over a ``RankGroup`` (see the module docstring)."""

    worker: type[RankWorker]
    """The Ray actor class of one rank (the strategy's)."""
    every_rank_forwards = False
    """Whether a forward needs every rank (sharded weights), even one given no rows."""

    def __init__(self, config: RlfleetConfig, model, pad_id: int) -> None:
        self.config = config
        self.cfg = config.trainer
        self.pad_id = pad_id
        self.updates = 0
        self._model = model
        self._weights: dict[str, torch.Tensor] | None = None
        self._model_stale = False
        self.group = RankGroup(config, model, pad_id, self.worker)

    @property
    def model(self):
        """The controller's copy of the policy, with rank 0's current weights."""
        if self._model_stale:
            weights = self.state_dict_for_rollout()
            with torch.no_grad():
                for name, param in self._model.named_parameters():
                    param.copy_(weights[name])
            self._model_stale = False
        return self._model

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        """Rank 0's parameters, fetched once per update (see the module docstring)."""
        if self._weights is None:
            self._weights = tensors_from_blobs(self.from_rank0("parameters"))
        return self._weights

    def update(self, batch, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """One update on every rank; rank 0's metrics (the same on every rank)."""
        import ray

        orders = epoch_orders(self.cfg.ppo_epochs, len(batch))
        payload = ray.put((UpdateRows.of(batch), advantages, mask, orders))
        results = self.group.call("update", payload)
        self._weights, self._model_stale = None, True
        metrics, self.updates = results[0]
        return metrics

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs, the rows split between the ranks (no grad), in rounds of at
        most ``trainer.ppo_micro_batch_size`` rows per rank: each rank then runs one forward a
        round, as FSDP's all-gathers need (shards of a whole batch could need one forward on a
        rank and two on the next)."""
        size = self.cfg.ppo_micro_batch_size * len(self.group.workers)
        return map_row_groups(prompts, responses, size, self._logprobs_round)

    def _logprobs_round(self, prompts: list[list[int]], responses: list[list[int]]) -> list:
        import ray

        world = len(self.group.workers)
        bounds = [shard_bounds(len(prompts), rank, world) for rank in range(world)]
        calls = [
            worker.logprobs.remote(prompts[lo:hi], responses[lo:hi])
            for worker, (lo, hi) in zip(self.group.workers, bounds, strict=True)
            if hi > lo or self.every_rank_forwards
        ]
        return [row for part in ray.get(calls) for row in part]

    def from_rank0(self, method: str):
        """Rank 0's answer to ``method`` (a replica holds everything on its own; a sharded
        strategy asks every rank, see ``rlfleet.trainer.fsdp``)."""
        return self.group.call_rank0(method)

    def save_hf(self, path: Path, tokenizer) -> Path:
        """Rank 0's weights as a Hugging Face directory (written by the controller)."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        return path

    def save_training_state(self, path: Path, extra: dict) -> None:
        """Rank 0's optimizer/schedule, in the single actor's format (interchangeable)."""
        state = self.from_rank0("training_state")
        write_training_state(path, {**state, **extra})

    def load_training_state(self, path: Path) -> dict:
        state = read_training_state(path)
        self.group.call("apply_training_state", state)
        self.updates = state["updates"]
        return state

    def close(self) -> None:
        """Stop the workers, free their placement group (and a Ray cluster started here)."""
        self.group.close()
