"""The critic: a value model for PPO/GAE, trained here with its own optimizer.

Why it lives in the refcritic: the trainer only needs numbers (values before an update, metrics
after), so the critic's weights and optimizer state never cross the network.

The value model is the policy's backbone (the causal LM from ``model.path`` without its lm-head)
plus a ``Linear(hidden, 1)`` head, zero-initialised so every value starts at 0 (a neutral
baseline) and the backbone's features are not disturbed by a random head. The value of response
token ``t`` is read at the *state before* it: the last hidden state of the column holding the
prompt and ``r_0..r_{t-1}`` (verl's convention; see ``rlfleet.rl.sequences``).

One ``update`` call = ``epochs`` optimizer steps over the whole batch. Micro-batches only bound
memory: each one's token-mean loss is weighted by its share of the batch's tokens, so the
accumulated gradient equals that of a single token-mean over the batch. The loss is PPO's
clipped value loss (Schulman et al. 2017, arXiv:1707.06347).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.model.model_io import load_causal_lm
from rlfleet.model.optim import adamw
from rlfleet.refcritic.inputs import BatchLimits, SequenceBatch, validate_batch, validate_rows
from rlfleet.refcritic.models import Rows
from rlfleet.refcritic.reference import pad_id_of, pick_device
from rlfleet.rl.core_algos import masked_mean, value_loss_clipped
from rlfleet.rl.sequences import (
    Packed,
    map_micro_batches,
    micro_batches,
    pack_sequences,
    pad_rows,
    state_hidden,
    unpack_rows,
)

log = logging.getLogger(__name__)

GRAD_CLIP = 1.0
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "value_model.safetensors", "optimizer.pt", "critic.json"


class ValueModel(torch.nn.Module):
    """Backbone + value head; ``forward(packed)`` gives float32 values [B, R], 0 on padding."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, packed: Packed) -> torch.Tensor:
        hidden = state_hidden(self.backbone, packed).float()  # head in float32 whatever the dtype
        return self.value_head(hidden).squeeze(-1) * packed.response_mask


@dataclass
class MicroBatch:
    """One packed micro-batch with its targets, [b, R] each, and its share of batch tokens."""

    packed: Packed
    returns: torch.Tensor
    old_values: torch.Tensor
    token_share: float


class Critic:
    """Values and clipped-value-loss updates; ``step`` counts optimizer steps taken."""

    def __init__(self, config: RlfleetConfig) -> None:
        settings = config.refcritic
        torch.set_num_threads(settings.torch_threads)
        self.device = pick_device()
        causal_lm = load_causal_lm(
            config.model.path, config.model.dtype, config.model.attn_implementation
        )
        self.model = ValueModel(causal_lm.base_model).to(self.device).eval()
        self.limits = BatchLimits.of(self.model.backbone)
        self.pad_id = pad_id_of(causal_lm)
        self.optimizer = adamw(self.model.parameters(), lr=settings.critic_lr, weight_decay=0.0)
        self.cliprange_value = settings.cliprange_value
        self.epochs = settings.critic_epochs
        self.micro_batch_size = settings.micro_batch_size
        self.step = 0
        log.info("critic ready on %s (backbone of %s)", self.device, config.model.path)

    def values(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """V(state before response token t) for every response token, one list per sequence."""
        validate_batch(SequenceBatch(prompts, responses), self.limits)
        self.model.eval()
        return map_micro_batches(prompts, responses, self.micro_batch_size, self._values_of)

    @torch.no_grad()
    def _values_of(self, prompts: list[list[int]], responses: list[list[int]]):
        packed = pack_sequences(prompts, responses, self.pad_id, self.device)
        return unpack_rows(self.model(packed), packed.response_lengths)

    def update(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        returns: list[list[float]],
        old_values: list[list[float]],
        epochs: int | None = None,
        micro_batch_size: int | None = None,
    ) -> dict[str, float]:
        """``epochs`` steps (0/None = config) of clipped value loss; verl-named mean metrics."""
        batch = SequenceBatch(prompts, responses)
        validate_batch(batch, self.limits)
        validate_rows(returns, batch, "returns")
        validate_rows(old_values, batch, "old_values")
        micros = self._prepare(
            batch, returns, old_values, micro_batch_size or self.micro_batch_size
        )
        self.model.train()
        try:
            steps = [self._optimizer_step(micros) for _ in range(epochs or self.epochs)]
        finally:
            self.model.eval()
        metrics = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _prepare(
        self, batch: SequenceBatch, returns: Rows, old_values: Rows, size: int
    ) -> list[MicroBatch]:
        keys = [(len(p), len(r)) for p, r in zip(batch.prompts, batch.responses, strict=True)]
        total = sum(batch.response_lengths)
        micros = []
        for group in micro_batches(keys, size):
            packed = pack_sequences(
                [batch.prompts[i] for i in group],
                [batch.responses[i] for i in group],
                self.pad_id,
                self.device,
            )
            width = packed.response_width
            ret = pad_rows([returns[i] for i in group], width, self.device)
            old = pad_rows([old_values[i] for i in group], width, self.device)
            share = sum(packed.response_lengths) / total
            micros.append(MicroBatch(packed, ret, old, share))
        return micros

    def _optimizer_step(self, micros: list[MicroBatch]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        totals = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/vpred_mean": 0.0}
        for micro in micros:
            for key, value in self._accumulate(micro).items():
                totals[key] += value * micro.token_share
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRAD_CLIP))
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.step += 1
        else:
            log.warning("critic update skipped: gradient norm is %s", grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        return {**totals, "critic/grad_norm": grad_norm}

    def _accumulate(self, micro: MicroBatch) -> dict[str, float]:
        """Backward of this micro-batch's share of the loss; its unweighted metrics."""
        mask = micro.packed.response_mask
        vpreds = self.model(micro.packed)
        vf_loss, clipfrac = value_loss_clipped(
            vpreds, micro.old_values, micro.returns, mask, self.cliprange_value
        )
        (vf_loss * micro.token_share).backward()
        vpred_mean = masked_mean(vpreds.detach(), mask)
        return {
            "critic/vf_loss": vf_loss.item(),
            "critic/vf_clipfrac": clipfrac.item(),
            "critic/vpred_mean": vpred_mean.item(),
        }

    def save(self, path: str | Path) -> str:
        """Weights (safetensors), optimizer state and step into directory ``path``; returns it.

        Each file is written under a temporary name and renamed, and ``critic.json`` goes last,
        so a directory with ``critic.json`` always holds a complete checkpoint.
        """
        directory = Path(path).resolve()
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomic(directory / MODEL_FILE, lambda tmp: save_model(self.model, str(tmp)))
        _write_atomic(
            directory / OPTIMIZER_FILE, lambda tmp: torch.save(self.optimizer.state_dict(), tmp)
        )
        state = json.dumps({"step": self.step, "format": 1})
        _write_atomic(directory / STATE_FILE, lambda tmp: tmp.write_text(state))
        log.info("critic checkpoint (step %d) saved to %s", self.step, directory)
        return str(directory)

    def load(self, path: str | Path) -> str:
        """Restore weights, optimizer state and step from a directory written by ``save``."""
        directory = Path(path).resolve()
        if not (directory / STATE_FILE).is_file():
            raise NotFound(f"no critic checkpoint at {directory} (missing {STATE_FILE})")
        try:
            load_model(
                self.model, str(directory / MODEL_FILE), strict=True, device=str(self.device)
            )
        except RuntimeError as exc:
            raise InvalidArgument(
                f"checkpoint {directory} does not fit this critic: {exc}"
            ) from exc
        state = torch.load(directory / OPTIMIZER_FILE, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state)
        self.step = int(json.loads((directory / STATE_FILE).read_text())["step"])
        log.info("critic checkpoint (step %d) loaded from %s", self.step, directory)
        return str(directory)


def _write_atomic(target: Path, write: Callable[[Path], object]) -> None:
    tmp = target.with_name(target.name + ".tmp")
    write(tmp)
    os.replace(tmp, target)
