"""The actor: the policy being trained, its optimizer, and the PPO-style update.

The loss is ``rlfleet.rl.losses.actor_loss``, pure functions over tensors: the PPO clipped
surrogate (Schulman et al. 2017, arXiv:1707.06347) on the advantages, plus an optional KL term
against the reference policy (GRPO, Shao et al. 2024, arXiv:2402.03300) and an optional
entropy bonus. The actor does not know which advantage estimator produced its inputs.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.model.optim import adamw
from rlfleet.rl import core_algos
from rlfleet.rl.label_logprobs import label_logprobs
from rlfleet.rl.losses import LossInputs, LossParams, actor_loss
from rlfleet.rl.rollout_correction import CorrectionParams
from rlfleet.rl.sequences import (
    pack_sequences,
    pad_rows,
    response_logits,
    response_logprobs,
    unpack_rows,
)
from rlfleet.rl.sft import sft_loss
from rlfleet.trainer.micro_batches import MetricSums as MetricSums
from rlfleet.trainer.micro_batches import loss_denominator as loss_denominator
from rlfleet.trainer.micro_batches import map_row_groups as map_row_groups
from rlfleet.trainer.micro_batches import micro_batch_count as micro_batch_count
from rlfleet.trainer.micro_batches import split_bounds as split_bounds

log = logging.getLogger(__name__)

TRAINER_STATE = "trainer_state.pt"
"""File of a checkpoint directory holding the optimizer, schedule and step counters."""


def epoch_orders(epochs: int, rows: int) -> list[list[int]]:
    """The row order of each PPO epoch: ``epochs`` random permutations of ``range(rows)``."""
    return [torch.randperm(rows).tolist() for _ in range(epochs)]


def checkpoint_activations(model) -> None:
    """Turn on transformers' gradient checkpointing (non-reentrant: works with inputs that need
    no grad, as a frozen base under a LoRA adapter). Only training-mode forwards recompute."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Actor:
    def __init__(self, config: RlfleetConfig, model, pad_id: int) -> None:
        self.config = config
        self.cfg = config.trainer
        self.model = model
        self.train_module = model
        """The module the update's forward runs through (a DDP wrapper on data-parallel ranks)."""
        self.pad_id = pad_id
        self.share_prompts_in_update = self.cfg.share_prompt_forward
        """Whether the update's forward shares each prompt's KV cache among its rows; off with
        gradient checkpointing (checkpointed layers return no cache)."""
        if config.model.enable_gradient_checkpointing:
            checkpoint_activations(model)
            self.share_prompts_in_update = False
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        """What the optimizer updates (all parameters, or only a LoRA adapter's)."""
        self.optimizer = adamw(self.trainable, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.updates = 0
        self.objective = "rl"
        """Which loss ``mini_batch_loss`` takes: ``rl`` (``actor_loss``) or ``sft``."""
        cfg = config.trainer
        self.loss_params = LossParams(
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            loss_agg_mode=cfg.loss_agg_mode,
            kl_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0,
            kl_type=cfg.kl_loss_type,
            entropy_coeff=cfg.entropy_coeff,
            is_cap=cfg.is_cap,
            clip_ratio_c=cfg.clip_ratio_c,
            policy_loss_mode=cfg.policy_loss_mode,
            loss_scale_factor=config.rollout.max_tokens,
            correction=correction_params(config),
        )

    def _lr_factor(self, step: int) -> float:
        """The learning rate of update ``step`` over ``trainer.lr``: the SFT warm-up's own rate
        for its steps, then ``lr_warmup_steps`` and ``lr_schedule``."""
        if step < self.cfg.sft_warmup_steps and self.cfg.sft_warmup_lr:
            return self.cfg.sft_warmup_lr / self.cfg.lr
        warmup = self.cfg.lr_warmup_steps
        if warmup and step < warmup:
            return (step + 1) / warmup
        if self.cfg.lr_schedule == "linear":
            remaining = max(1, self.cfg.total_steps - warmup)
            return max(0.0, 1.0 - (step - warmup) / remaining)
        return 1.0

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (the batch is packed there)."""
        return next(self.model.parameters()).device

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        """Parameters the engines load; tied embeddings are sent once, under their own name."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def logprobs(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        temperature: float | None = None,
    ) -> list[list[float]]:
        """Per-token log-probs of the responses under the current weights (no grad), at most
        ``trainer.ppo_micro_batch_size`` rows per forward (the logits are ``[rows, tokens,
        vocab]``); at ``temperature``, by default the sampling one (``rollout.temperature``)."""
        self.model.eval()
        size = self.cfg.ppo_micro_batch_size
        return map_row_groups(
            prompts, responses, size, functools.partial(self._logprobs_of, temperature=temperature)
        )

    def _logprobs_of(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float | None
    ) -> list:
        packed = pack_sequences(prompts, responses, self.pad_id, self.device)
        temperature = temperature or self.config.rollout.temperature or 1.0
        with self.autocast():
            out = response_logprobs(self.model, packed, temperature, self.cfg.share_prompt_forward)
        return unpack_rows(out, packed.response_lengths)

    def autocast(self) -> torch.autocast:
        """bf16 autocast of the actor's forwards when ``trainer.autocast_dtype`` asks for it
        (``uses_bf16``; the backward follows the forward's dtypes); a no-op context otherwise."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.uses_bf16)

    @functools.cached_property
    def uses_bf16(self) -> bool:
        """``trainer.autocast_dtype``: ``bfloat16``, or ``auto`` where bf16 is fast here."""
        mode = self.cfg.autocast_dtype
        if mode == "auto":
            from rlfleet.model.precision import fast_bf16

            return fast_bf16(self.device.type)
        return mode == "bfloat16"

    def update(
        self, batch, advantages: torch.Tensor, mask: torch.Tensor, orders=None
    ) -> dict[str, float]:
        """PPO epochs over mini-batches; returns verl-named metrics (means over mini-batches).

        ``orders``: the row order of each epoch (default: ``epoch_orders``, drawn here);
        data-parallel ranks all get the controller's, so they walk the same mini-batches."""
        self.model.train()
        extras = self._padded_extras(batch, mask.shape[1])
        size = self.cfg.ppo_mini_batch_size or len(batch)
        sums: dict[str, float] = {}
        count = 0
        if orders is None:
            orders = epoch_orders(self.cfg.ppo_epochs, len(batch))
        for order in orders:
            for start in range(0, len(order), size):
                idx, scale = self._rows_with_gradient(order[start : start + size], advantages, mask)
                rows = {name: value[idx] for name, value in extras.items()}
                step_metrics = self._mini_batch_step(
                    batch, idx, advantages[idx], mask[idx], rows, scale
                )
                for key, value in step_metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
        self.scheduler.step()
        metrics = {key: value / max(1, count) for key, value in sums.items()}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def sft_update(self, batch, mask: torch.Tensor) -> dict[str, float]:
        """One optimizer step of supervised learning on the whole ``batch`` (an
        ``rlfleet.trainer.sft.SftBatch``): the negative log-likelihood of the tokens ``mask``
        ``[B, T]`` marks, in micro-batches like the RL update."""
        self.model.train()
        self.objective = "sft"
        try:
            idx = list(range(len(batch)))
            metrics = self._mini_batch_step(batch, idx, torch.zeros_like(mask), mask, {})
        finally:
            self.objective = "rl"
        self.scheduler.step()
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _rows_with_gradient(self, idx: list[int], advantages, mask) -> tuple[list[int], float]:
        """Drop rows whose advantage is zero on every token, when that is exact.

        With no KL and no entropy term, such a row's loss is ``-0 * ratio``: it adds nothing
        to the gradient, only to the aggregation's denominator. Training the other rows and
        scaling their loss by their share of that denominator gives the same gradient for
        less compute (GRPO groups whose samples all scored the same). Returns the rows and
        the scale.
        """
        params = self.loss_params
        if params.kl_coef or params.entropy_coeff:
            return idx, 1.0
        rows_mask = mask[idx]
        live = ((advantages[idx] != 0) & (rows_mask > 0)).any(-1)
        if bool(live.all()):
            return idx, 1.0
        mode = params.effective_agg_mode
        total, kept = loss_denominator(mode, rows_mask), loss_denominator(mode, rows_mask[live])
        kept_idx = [i for i, keep in zip(idx, live.tolist(), strict=True) if keep]
        return kept_idx, float(kept / total.clamp_min(1))

    @staticmethod
    def _padded_extras(batch, width: int) -> dict[str, torch.Tensor]:
        """The optional per-token inputs the batch carries, padded to ``[B, width]``."""
        sources = {
            "old_logprob": batch.old_logprobs,
            "ref_logprob": batch.ref_logprobs,
            "behaviour_logprob": batch.behaviour_logprobs,
            "rollout_logprob": batch.rollout_logprobs,
            "rollout_is_weights": batch.rollout_is_weights,
        }
        return {name: pad_rows(rows, width) for name, rows in sources.items() if rows}

    def _mini_batch_step(self, batch, idx, adv, mask, rows, scale=1.0) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        if not idx:  # no row carries a gradient; the optimizer still steps (momentum, decay)
            for param in self.trainable:
                param.grad = torch.zeros_like(param)
            return self._step_optimizer({"actor/trained_fraction": 0.0})
        metrics = self._backward(batch, idx, adv, mask, rows, scale)
        metrics["actor/trained_fraction"] = scale
        return self._step_optimizer(metrics)

    def _backward(self, batch, idx, adv, mask, rows, scale: float) -> dict[str, float]:
        """Gradient of ``scale`` times the loss of rows ``idx``, in micro-batches of at most
        ``trainer.ppo_micro_batch_size`` rows (data-parallel ranks override this to train their
        shard of the rows the same way)."""
        count = micro_batch_count(len(idx), self.cfg.ppo_micro_batch_size)
        groups = self.micro_batch_groups(batch, idx, range(len(idx)), count)
        return self.backward_groups(batch, idx, adv, mask, rows, groups, scale)

    @staticmethod
    def micro_batch_groups(batch, idx, positions: range, count: int) -> list[list[int]]:
        """``positions`` (into ``idx``) cut into ``count`` micro-batches whose sizes differ by
        <= 1 (empty ones when there are fewer positions than ``count``). With more than one,
        rows of one prompt go together (the shared-prompt forward runs a prompt once per
        micro-batch), then by response length (less padding)."""
        order = list(positions)
        if count > 1:
            order.sort(key=lambda i: (batch.prompts[idx[i]], len(batch.responses[idx[i]])))
        bounds = (split_bounds(len(order), part, count) for part in range(count))
        return [order[lo:hi] for lo, hi in bounds]

    def backward_groups(self, batch, idx, adv, mask, rows, groups, weight) -> dict[str, float]:
        """Forward and backward of each micro-batch of ``groups`` (positions into ``idx``; the
        tensors are ``idx``'s rows) in turn, its loss times ``weight`` times its share of the
        ``loss_denominator`` of the whole ``mask``: the summed gradient is ``weight`` times that
        of one forward over every row, whatever ``loss_agg_mode``, and only one micro-batch's
        logits and activations are alive at a time. An empty group runs row 0 with weight 0 (a
        data-parallel rank must run as many forwards and backwards as the others). Returns the
        metrics summed as shares of the whole (``MetricSums``)."""
        sums = MetricSums(self.loss_params.effective_agg_mode, mask)
        for group in groups:
            picked = group or [0]
            loss, metrics = self.mini_batch_loss(
                batch,
                [idx[i] for i in picked],
                adv[picked],
                mask[picked],
                {name: value[picked] for name, value in rows.items()},
            )
            share = sums.add(metrics, mask[group])
            (loss * (weight * share)).backward()
        return sums.metrics

    def mini_batch_loss(self, batch, idx, adv, mask, rows) -> tuple[torch.Tensor, dict]:
        """Forward of rows ``idx`` of ``batch`` through ``train_module`` and the actor loss.

        ``adv``/``mask`` and each of ``rows`` (old/ref/behaviour log-probs) are ``[len(idx),
        T]``, already picked for ``idx``. Returns the scalar loss and verl-named metrics."""
        device = self.device
        packed = pack_sequences(
            [batch.prompts[i] for i in idx], [batch.responses[i] for i in idx], self.pad_id, device
        )
        with self.autocast():
            logits = response_logits(self.train_module, packed, self.share_prompts_in_update)
        width = packed.response_width
        if self.objective == "sft":  # the model's own distribution: no sampling temperature
            logprob, _ = label_logprobs(logits, packed.responses)
            return sft_loss(
                logprob, mask[:, :width].to(device), self.loss_params.effective_agg_mode
            )
        temperature = self.config.rollout.temperature or 1.0
        logprob, entropy, logits = self._logprob_and_entropy(logits, packed, temperature)
        rows = {name: value[:, :width].to(device) for name, value in rows.items()}
        # No old log-probs means an on-policy single step: the ratio is 1 by construction.
        rows.setdefault("old_logprob", logprob.detach())
        inputs = LossInputs(
            logits=logits,
            logprob=logprob,
            advantages=adv[:, :width].to(device),
            response_mask=mask[:, :width].to(device),
            entropy=entropy,
            **rows,
        )
        return actor_loss(self.loss_params, inputs)

    def _logprob_and_entropy(self, logits, packed, temperature: float):
        """``(logprob, entropy, logits)`` of the sampled tokens at ``temperature``: fused
        (``label_logprobs``: no float32 copies of the ``[B, T, V]`` logits kept for the
        backward; entropy as a metric) unless the loss has an entropy bonus, which needs the
        entropy's gradient and so the plain path (then ``logits / T`` in float32 is returned
        for ``LossInputs``)."""
        if not self.loss_params.entropy_coeff:
            logprob, entropy = label_logprobs(logits, packed.responses, temperature, True)
            return logprob, entropy, logits
        scaled = logits.float() / temperature
        return core_algos.logprobs_from_logits(scaled, packed.responses), None, scaled

    def _step_optimizer(self, metrics: dict[str, float]) -> dict[str, float]:
        """Clip, step, and record the gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, self.cfg.grad_clip)
        self.optimizer.step()
        self.updates += 1
        metrics["actor/grad_norm"] = float(grad_norm)
        return metrics

    def close(self) -> None:
        """Nothing to release in one process (a data-parallel actor stops its workers)."""

    def save_hf(self, path: Path, tokenizer) -> Path:
        """Hugging Face directory (config, safetensors, tokenizer) loadable by vLLM and HF."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        return path

    def load_training_state(self, path: Path) -> dict:
        """Restore optimizer/scheduler state saved by ``save_training_state``; returns extras."""
        state = read_training_state(path)
        self.apply_training_state(state)
        return state

    def save_training_state(self, path: Path, extra: dict) -> None:
        """Optimizer/scheduler state for resuming (next to the HF weights)."""
        write_training_state(path, {**self.training_state(), **extra})

    def training_state(self) -> dict:
        """What a checkpoint needs besides the weights: optimizer, schedule, update count."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "updates": self.updates,
        }

    def apply_training_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates = state["updates"]


def correction_params(config: RlfleetConfig) -> CorrectionParams | None:
    """``algorithm.rollout_correction`` for the loss, None when it is off."""
    corr = config.algorithm.rollout_correction
    if not corr.active:
        return None
    return CorrectionParams(**corr.model_dump(exclude={"preset"}))


def write_training_state(path: Path, state: dict) -> None:
    """``trainer_state.pt`` written whole or not at all (a temporary file, then a rename): it is
    what marks a checkpoint complete, and a trainer killed while saving must not leave half."""
    partial = path / f"{TRAINER_STATE}.partial"
    torch.save(state, partial)
    os.replace(partial, path / TRAINER_STATE)


def read_training_state(path: Path) -> dict:
    """The ``trainer_state.pt`` of checkpoint directory ``path``."""
    from rlfleet.common.errors import InvalidArgument

    file = path / TRAINER_STATE
    if not file.is_file():
        raise InvalidArgument(f"{path} is not a trainer checkpoint (no {TRAINER_STATE})")
    return torch.load(file, weights_only=True)
