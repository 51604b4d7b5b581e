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
        width = mask.shape[1]
        old = pad_rows(batch.old_logprobs, width) if batch.old_logprobs else None
        ref = pad_rows(batch.ref_logprobs, width) if batch.ref_logprobs else None
        size = self.cfg.ppo_mini_batch_size or len(batch)
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(len(batch)).tolist()
            for start in range(0, len(order), size):
                idx = order[start : start + size]
                rows = (
                    old[idx] if old is not None else None,
                    ref[idx] if ref is not None else None,
                    advantages[idx],
                    mask[idx],
                )
                step_metrics = self._mini_batch_step(batch, idx, *rows)
                for key, value in step_metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
        self.scheduler.step()
        metrics = {key: value / max(1, count) for key, value in sums.items()}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _mini_batch_step(self, batch, idx, old, ref, adv, mask) -> dict[str, float]:
        packed = pack_sequences(
            [batch.prompts[i] for i in idx], [batch.responses[i] for i in idx], self.pad_id
        )
        logits = response_logits(self.model, packed)
        temperature = self.config.rollout.temperature or 1.0
        logits = logits / temperature if temperature != 1.0 else logits
        width = packed.response_width
        adv, mask = adv[:, :width], mask[:, :width]
        logprob = core_algos.logprobs_from_logits(logits, packed.responses)
        # No old log-probs means an on-policy single step: the ratio is 1 by construction.
        old = old[:, :width] if old is not None else logprob.detach()
        loss, metrics = self._loss(logits, logprob, old, ref, adv, mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.updates += 1
        metrics["actor/grad_norm"] = float(grad_norm)
        return metrics

    def _loss(self, logits, logprob, old, ref, adv, mask):
        cfg = self.cfg
        out = core_algos.policy_loss_ppo_clip(
            old, logprob, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.loss_agg_mode
        )
        loss = out.pg_loss
        metrics = {
            "actor/pg_loss": out.pg_loss.item(),
            "actor/pg_clipfrac": out.pg_clipfrac.item(),
            "actor/ppo_kl": out.ppo_kl.item(),
        }
        if cfg.use_kl_loss and ref is not None:
            kl = core_algos.kl_penalty(logprob, ref[:, : mask.shape[1]], cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kl, mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.item()
        entropy = core_algos.agg_loss(
            core_algos.entropy_from_logits(logits), mask, cfg.loss_agg_mode
        )
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * entropy
        metrics["actor/entropy"] = entropy.item()
        return loss, metrics

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
