"""The actor: the policy being trained, its optimizer, and the PPO-style update.

The loss is assembled from ``core_algos`` pure functions: the PPO clipped surrogate
(Schulman et al. 2017, arXiv:1707.06347) on the advantages, plus an optional KL term
against the reference policy (GRPO, Shao et al. 2024, arXiv:2402.03300) and an optional
entropy bonus. The actor does not know which advantage estimator produced its inputs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.rl import core_algos
from rlfleet.rl.losses import LossInputs, LossParams, actor_loss
from rlfleet.rl.sequences import (
    pack_sequences,
    pad_rows,
    response_logits,
    response_logprobs,
    unpack_rows,
)

log = logging.getLogger(__name__)


class Actor:
    def __init__(self, config: RlfleetConfig, model, pad_id: int) -> None:
        self.config = config
        self.cfg = config.trainer
        self.model = model
        self.pad_id = pad_id
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.updates = 0
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
        )

    def _lr_factor(self, step: int) -> float:
        warmup = self.cfg.lr_warmup_steps
        if warmup and step < warmup:
            return (step + 1) / warmup
        if self.cfg.lr_schedule == "linear":
            remaining = max(1, self.cfg.total_steps - warmup)
            return max(0.0, 1.0 - (step - warmup) / remaining)
        return 1.0

    def state_dict_for_rollout(self) -> dict[str, torch.Tensor]:
        """Parameters the engines load; tied embeddings are sent once, under their own name."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """Per-token log-probs of the responses under the current weights (no grad)."""
        self.model.eval()
        packed = pack_sequences(prompts, responses, self.pad_id)
        temperature = self.config.rollout.temperature or 1.0
        out = response_logprobs(self.model, packed, temperature)
        return unpack_rows(out, packed.response_lengths)

    def update(self, batch, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """PPO epochs over mini-batches; returns verl-named metrics (means over mini-batches)."""
        self.model.train()
        extras = self._padded_extras(batch, mask.shape[1])
        size = self.cfg.ppo_mini_batch_size or len(batch)
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(len(batch)).tolist()
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
        if mode == "seq-mean-token-sum-norm":  # a constant divisor: dropped rows change nothing
            total, kept = torch.tensor(1.0), torch.tensor(1.0)
        elif mode == "token-mean":
            total, kept = rows_mask.sum(), rows_mask[live].sum()
        else:
            total, kept = (rows_mask.sum(-1) > 0).sum(), live.sum()
        kept_idx = [i for i, keep in zip(idx, live.tolist(), strict=True) if keep]
        return kept_idx, float(kept / total.clamp_min(1))

    @staticmethod
    def _padded_extras(batch, width: int) -> dict[str, torch.Tensor]:
        """The optional per-token inputs the batch carries, padded to ``[B, width]``."""
        sources = {
            "old_logprob": batch.old_logprobs,
            "ref_logprob": batch.ref_logprobs,
            "behaviour_logprob": batch.behaviour_logprobs,
        }
        return {name: pad_rows(rows, width) for name, rows in sources.items() if rows}

    def _mini_batch_step(self, batch, idx, adv, mask, rows, scale=1.0) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        if not idx:  # no row carries a gradient; the optimizer still steps (momentum, decay)
            for param in self.model.parameters():
                param.grad = torch.zeros_like(param)
            return self._step_optimizer({"actor/trained_fraction": 0.0})
        packed = pack_sequences(
            [batch.prompts[i] for i in idx], [batch.responses[i] for i in idx], self.pad_id
        )
        logits = response_logits(self.model, packed)
        temperature = self.config.rollout.temperature or 1.0
        logits = logits / temperature if temperature != 1.0 else logits
        width = packed.response_width
        logprob = core_algos.logprobs_from_logits(logits, packed.responses)
        rows = {name: value[:, :width] for name, value in rows.items()}
        # No old log-probs means an on-policy single step: the ratio is 1 by construction.
        rows.setdefault("old_logprob", logprob.detach())
        inputs = LossInputs(
            logits=logits,
            logprob=logprob,
            advantages=adv[:, :width],
            response_mask=mask[:, :width],
            **rows,
        )
        loss, metrics = actor_loss(self.loss_params, inputs)
        (loss * scale).backward()
        metrics["actor/trained_fraction"] = scale
        return self._step_optimizer(metrics)

    def _step_optimizer(self, metrics: dict[str, float]) -> dict[str, float]:
        """Clip, step, and record the gradient norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.updates += 1
        metrics["actor/grad_norm"] = float(grad_norm)
        return metrics

    def save_hf(self, path: Path, tokenizer) -> Path:
        """Hugging Face directory (config, safetensors, tokenizer) loadable by vLLM and HF."""
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
        return path

    def load_training_state(self, path: Path) -> dict:
        """Restore optimizer/scheduler state saved by ``save_training_state``; returns extras."""
        from rlfleet.common.errors import InvalidArgument

        file = path / "trainer_state.pt"
        if not file.is_file():
            raise InvalidArgument(f"{path} is not a trainer checkpoint (no trainer_state.pt)")
        state = torch.load(file, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.updates = state["updates"]
        return state

    def save_training_state(self, path: Path, extra: dict) -> None:
        """Optimizer/scheduler state for resuming (next to the HF weights)."""
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "updates": self.updates,
                **extra,
            },
            path / "trainer_state.pt",
        )
