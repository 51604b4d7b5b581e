"""Reward shaping between scoring and the advantage: KL in the reward and DAPO's overlong
penalty, both from ``algorithm.*`` in the config.

The math is in ``rlfleet.rl.shaping``; this module only picks the tensors out of a
``RolloutBatch`` and the knobs out of the config, so ``Trainer.advantages`` needs two calls
(``shaping_inputs``, ``shape_rewards``).
The scores the reward service returned stay untouched in the batch (``critic/score/*``); the
shaped per-token rewards are what the estimator sees (``critic/rewards/mean``, as in verl).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.rl.sequences import pad_rows
from rlfleet.rl.shaping import (
    KLController,
    apply_kl_penalty,
    make_kl_controller,
    overlong_penalty,
)


@dataclass
class ShapingInputs:
    """What shaping reads; tensors are ``[B, T]``."""

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    logprob: torch.Tensor | None = None
    """The sampling policy's log-probs (KL in the reward)."""
    ref_logprob: torch.Tensor | None = None
    """The reference policy's log-probs (KL in the reward)."""


def shaping_inputs(batch, rewards: torch.Tensor, mask: torch.Tensor) -> ShapingInputs:
    """From a ``RolloutBatch``: the actor's old log-probs when they were computed, else the
    engine's (the same policy when the update is on-policy)."""
    width = mask.shape[1]
    policy = batch.old_logprobs or _complete(batch.engine_logprobs, batch.responses)
    return ShapingInputs(
        token_level_rewards=rewards,
        response_mask=mask,
        logprob=pad_rows(policy, width) if policy else None,
        ref_logprob=pad_rows(batch.ref_logprobs, width) if batch.ref_logprobs else None,
    )


def _complete(rows: list[list[float]], responses: list[list[int]]) -> list[list[float]]:
    """``rows`` when every response token has a log-prob, else []."""
    ok = len(rows) == len(responses) and all(
        len(r) == len(t) for r, t in zip(rows, responses, strict=True)
    )
    return rows if ok else []


def kl_controller_for(config: RlfleetConfig) -> KLController | None:
    """The in-reward KL coefficient's controller; None when ``use_kl_in_reward`` is off. Keep
    it on the trainer: the adaptive one carries its coefficient from step to step."""
    algo = config.algorithm
    if not algo.use_kl_in_reward:
        return None
    ctrl = algo.kl_ctrl
    return make_kl_controller(ctrl.type, ctrl.kl_coef, ctrl.target_kl, ctrl.horizon)


def shape_rewards(
    x: ShapingInputs, config: RlfleetConfig, kl_ctrl: KLController | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """(shaped rewards ``[B, T]``, verl-named metrics); the rewards as given when nothing is on."""
    rewards, metrics = x.token_level_rewards, {}
    buffer = config.algorithm.overlong_buffer
    if buffer.enable:
        rewards, metrics = _add_overlong(rewards, x.response_mask, config)
    if kl_ctrl is not None:
        rewards, kl_metrics = _subtract_kl(rewards, x, config, kl_ctrl)
        metrics.update(kl_metrics)
    if metrics:
        metrics["critic/rewards/mean"] = (rewards * x.response_mask).sum(-1).mean().item()
    return rewards, metrics


def _add_overlong(rewards, mask, config: RlfleetConfig):
    """The DAPO penalty added on each response's last token (where the outcome score sits)."""
    buffer = config.algorithm.overlong_buffer
    lengths = mask.sum(-1).long()
    penalty = overlong_penalty(
        lengths, config.rollout.max_tokens, buffer.len, buffer.penalty_factor
    )
    rows = torch.arange(len(lengths))
    shaped = rewards.clone()
    shaped[rows, (lengths - 1).clamp_min(0)] += penalty.to(rewards.dtype)
    metrics = {
        "reward/overlong_penalty/mean": penalty.mean().item(),
        "reward/overlong_fraction": (penalty < 0).float().mean().item(),
    }
    return shaped, metrics


def _subtract_kl(rewards, x: ShapingInputs, config: RlfleetConfig, kl_ctrl: KLController):
    if x.logprob is None or x.ref_logprob is None:
        raise ValueError(
            "algorithm.use_kl_in_reward needs the policy's and the reference's log-probs per "
            "token (old_logprobs or complete engine log-probs, and ref_logprobs)"
        )
    beta = kl_ctrl.value
    shaped, kl_mean = apply_kl_penalty(
        rewards, x.logprob, x.ref_logprob, x.response_mask, beta, config.algorithm.kl_penalty
    )
    kl_ctrl.update(kl_mean, n_steps=len(rewards))
    return shaped, {"actor/reward_kl_penalty": kl_mean, "actor/reward_kl_penalty_coeff": beta}
