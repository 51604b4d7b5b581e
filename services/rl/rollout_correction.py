"""Rollout correction: training on samples another engine drew, as verl corrects for it.

Why: the engine that sampled a response (vLLM in bf16, another kernel, weights a version or two
old in asynchronous training) and the trainer's policy give the same tokens different
probabilities. Left alone this training-inference mismatch silently biases the gradient and
can collapse a long run ("When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch", Liu et al. 2025, https://richardli.xyz/rl-collapse; Yao et al.
2025, "Your efficient RL framework secretly brings you off-policy RL training",
https://fengyao.notion.site/off-policy-rl). verl's rollout correction
(``verl.trainer.ppo.rollout_corr_helper``) offers, over the log-ratio
``log r = log pi_train - log pi_rollout`` per token:

- importance weights (``rollout_is``): per token or per sequence (the product over the
  response), truncated at an upper bound (truncated IS: Espeholt et al. 2018, IMPALA,
  arXiv:1802.01561) or, given ``"lower_upper"``, zeroed outside the bounds (IcePop, the
  Ring-1T report, Ling Team 2025, arXiv:2510.18855);
- rejection (``rollout_rs``): tokens or sequences whose k1/k2/k3 divergence (Schulman's
  estimators, http://joschu.net/blog/kl-approx.html) is out of bounds leave the loss; the
  sequence mean of k1 is the geometric-mean ratio filter ("Geo-RS");
- bypass mode: the engine's log-probs are the PPO old policy (no recompute), with a PPO-clip
  or a REINFORCE loss (``reinforce_loss``).

These functions are written for rlfleet (not copied) and checked equal to verl's on random
batches by ``scripts/check_rollout_correction_parity.py``; the statistics they report are in
``rlfleet.rl.rollout_correction_metrics``. Shapes: ``B`` sequences, ``T`` response tokens;
every tensor is ``[B, T]`` unless said otherwise; ``mask`` is 1 on the tokens the policy
sampled (agent mode's loss mask included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlfleet.common.config.rollout_correction import (
    parse_is_threshold,
    parse_rs_thresholds,
    rs_option_list,
)
from rlfleet.rl.core_algos import LossAggMode, agg_loss, masked_mean, masked_sum
from rlfleet.rl.rollout_correction_metrics import (
    SAFETY_BOUND,
    is_weight_metrics,
    mismatch_metrics,
    prefixed,
    rejection_metrics,
)


@dataclass(frozen=True)
class CorrectionParams:
    """``algorithm.rollout_correction`` as the functions take it (verl's names)."""

    rollout_is: str | None = None
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"


@dataclass
class Correction:
    """What ``correct`` returns: ``weights`` ``[B, T]`` (None without ``rollout_is``), the
    ``mask`` with rejected tokens set to 0, and ``rollout_corr/*`` metrics."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, float]


def is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str = "token",
    threshold: str | float = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached importance weights ``[B, T]`` (0 on padding) and their ``rollout_is_*``
    statistics. ``level``: ``token`` (``exp(log r)`` per token) or ``sequence`` (``exp`` of
    the response's summed ``log r`` on each of its tokens). ``threshold``: a number clamps
    the weights at it; ``"lower_upper"`` zeroes those outside (IcePop). ``batch_normalize``
    divides by the mean weight (over tokens, or over sequences for ``sequence``)."""
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is must be token or sequence, not {level!r}")
    upper, lower = parse_is_threshold(threshold)
    if level == "token":
        stat_log_ratio = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        stat_log_ratio = masked_sum(log_ratio, mask, -1).unsqueeze(-1)
        raw = torch.exp(stat_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        inside = (raw >= lower) & (raw <= upper)
        weights = torch.where(inside, raw, torch.zeros_like(raw))
    metrics = is_weight_metrics(weights, raw, stat_log_ratio, mask, level, upper, lower)
    if lower is not None:
        outside = ((raw < lower) | (raw > upper)).float()
        metrics["rollout_is_oob_ratio"] = float(masked_mean(outside, mask))
    weights = weights.detach()
    if batch_normalize:
        weights, metrics["rollout_is_batch_norm_factor"] = _normalized(weights, mask, level)
    return weights, metrics


def _normalized(weights: torch.Tensor, mask: torch.Tensor, level: str):
    """``weights`` over their batch mean, and the mean (1.0 when it is ~0: left as is)."""
    if level == "token":
        mean = masked_mean(weights, mask)
    else:
        has_tokens = (mask.sum(-1) > 0).to(weights.dtype)
        per_seq = masked_mean(weights, mask, -1)
        mean = (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
    if mean <= 1e-8:
        return weights, 1.0
    return weights / mean, float(mean)


def divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token ``k1 = -log r``, ``k2 = (log r)^2 / 2``, ``k3 = r - 1 - log r`` of the
    clamped log-ratio, ``[B, T]`` each."""
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}


def sequence_stat(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """``[B]``: the sum, mean or max (``how``) of ``per_token`` over each row's tokens (max 0
    for a row with none)."""
    if how == "sum":
        return masked_sum(per_token, mask, -1)
    if how == "mean":
        return masked_mean(per_token, mask, -1)
    peak = per_token.masked_fill(~mask.bool(), float("-inf")).max(-1).values
    return torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)


def rejection_mask(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    rollout_rs: str,
    threshold: str | float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``mask`` with every token (``token_*``) or sequence (``seq_*``) that fails any option
    of ``rollout_rs`` set to 0, and the ``rollout_rs_*`` statistics. k1 options keep
    ``lower <= pi_rollout / pi_train <= upper`` (compared in log space); k2/k3 options keep a
    divergence ``<= upper``."""
    options = rs_option_list(rollout_rs)
    bounds = parse_rs_thresholds(options, threshold)
    if log_ratio.shape[0] == 0:
        return mask, {}
    per_token = divergences(log_ratio)
    has_tokens = mask.sum(-1) > 0
    keep_all = torch.ones_like(mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        keep, option_metrics = _option_keep(option, per_token, mask, bounds[option])
        keep_all = keep_all * keep.to(log_ratio.dtype)
        metrics.update(option_metrics)
        metrics.update(_masked_fractions(option, keep, mask, has_tokens))
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(1 - keep_all, mask))
    on_tokens = mask.bool()
    rejected_rows = (on_tokens & ~(keep_all > 0.5)).any(-1)
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected_rows.float().mean())
    return (mask * keep_all).to(mask.dtype), metrics


def _option_keep(option: str, per_token, mask, bounds) -> tuple[torch.Tensor, dict]:
    """Boolean keep ``[B, T]`` of one option, and its statistics."""
    lower, upper = bounds
    level, _, kind = option.rpartition("_")
    k1 = kind == "k1"
    low = math.log(lower) if k1 and lower is not None else None
    high = math.log(upper) if k1 else upper
    seq = None
    stat = per_token[kind]
    if level != "token":
        seq = sequence_stat(stat, mask, level.removeprefix("seq_"))
        stat = seq.unsqueeze(-1).expand_as(mask)
    keep = stat <= high if low is None else (stat >= low) & (stat <= high)
    metrics = rejection_metrics(option, stat, mask, seq, high, low)
    return keep, metrics


def _masked_fractions(option: str, keep, mask, has_tokens) -> dict[str, float]:
    """Fractions of an option's rejected tokens, and of the sequences it rejects a token of."""
    tokens = float(masked_mean(1 - keep.to(mask.dtype), mask))
    rows_rejected = ((~keep) & mask.bool()).any(-1).to(mask.dtype)
    valid = has_tokens.to(mask.dtype)
    seqs = float((rows_rejected * valid).sum() / valid.sum()) if valid.sum() > 0 else 0.0
    return {
        f"rollout_rs_{option}_masked_fraction": tokens,
        f"rollout_rs_{option}_seq_masked_fraction": seqs,
    }


def correct(
    old_logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    mask: torch.Tensor,
    params: CorrectionParams,
) -> Correction:
    """The whole correction of one batch: weights (``rollout_is``), the rejection mask
    (``rollout_rs``) and every ``rollout_corr/*`` metric, mismatch ones included.
    ``old_logprob`` is the trainer's policy (the old policy in decoupled mode, the current
    one in bypass mode), ``rollout_logprob`` the engine's."""
    if not mask.any():
        raise ValueError("the mask needs at least one token")
    if old_logprob.shape != rollout_logprob.shape or old_logprob.shape != mask.shape:
        raise ValueError(
            f"shapes differ: {tuple(old_logprob.shape)}, {tuple(rollout_logprob.shape)}, "
            f"{tuple(mask.shape)}"
        )
    log_ratio = old_logprob - rollout_logprob
    metrics: dict[str, float] = {}
    weights = None
    if params.rollout_is is not None:
        weights, is_metrics = is_weights(
            log_ratio,
            mask,
            params.rollout_is,
            params.rollout_is_threshold,
            params.rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    kept = mask.clone()
    if params.rollout_rs is not None:
        kept, rs_metrics = rejection_mask(
            log_ratio, mask, params.rollout_rs, params.rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(mismatch_metrics(old_logprob, rollout_logprob, mask))
    return Correction(weights, kept, prefixed(metrics))


def reinforce_loss(
    logprob: torch.Tensor,
    rollout_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: LossAggMode,
    weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bypass mode's REINFORCE loss ``-A * w * log pi`` aggregated by ``agg_mode`` (``w`` the
    detached IS weights, 1 when None; Williams 1992), and ``ppo_kl`` = mean of ``log
    pi_rollout - log pi`` over the mask. Returns ``(loss, ppo_kl)``, scalars."""
    losses = -advantages * logprob
    if weights is not None:
        losses = losses * weights
    loss = agg_loss(losses, mask, agg_mode, loss_scale_factor)
    return loss, masked_mean(rollout_logprob - logprob, mask).detach()
