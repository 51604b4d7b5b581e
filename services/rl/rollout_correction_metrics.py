"""What the rollout correction watches: the mismatch between the engine that sampled a batch and
the trainer's policy, and the statistics of the weights and rejections that correct for it.

Names and definitions are verl's (``rollout_corr/...``), so a dashboard built for verl reads a
rlfleet run. Why these: a rising ``kl``/``k3_kl`` or ``chi2_token``/``chi2_seq`` between
engine and trainer is the early sign of the collapse that "When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch" (Liu et al. 2025,
https://richardli.xyz/rl-collapse) describes; ``log_ppl_diff`` and ``ppl_ratio`` say which
side is more confident; chi-square is the variance of the importance weights (Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training",
https://fengyao.notion.site/off-policy-rl). All statistics count only the tokens the policy
sampled (``mask`` is the response mask, agent mode's loss mask included).

Shapes: ``B`` sequences, ``T`` response tokens; every tensor argument is ``[B, T]`` unless
said otherwise. Values are Python floats.
"""

from __future__ import annotations

import torch

from rlfleet.rl.core_algos import masked_mean, masked_sum

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` (exp(20) ~ 4.9e8): no inf in a weight."""


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(x.masked_fill(~mask.bool(), float("-inf")).max())


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(x.masked_fill(~mask.bool(), float("inf")).min())


def clamped_std(x: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> float:
    """Std over the masked tokens of ``x`` clamped to ``[low, high]`` (0 with one token)."""
    if mask.sum() <= 1:
        return 0.0
    clamped = x.clamp(min=low, max=high)
    mean = masked_mean(clamped, mask)
    return float((masked_mean(clamped.square(), mask) - mean.square()).clamp_min(0).sqrt())


def mismatch_metrics(
    policy_logprob: torch.Tensor, rollout_logprob: torch.Tensor | None, mask: torch.Tensor
) -> dict[str, float]:
    """verl's off-policy diagnostics (unprefixed) of the trainer's log-probs against the
    engine's: ``training_ppl`` and ``training_log_ppl`` always; with ``rollout_logprob``
    also ``kl`` (k1 of KL(rollout || train)), ``k3_kl``, ``rollout_ppl``, ``rollout_log_ppl``,
    ``log_ppl_diff`` (mean, ``_max``, ``_min``, ``log_ppl_abs_diff``), ``ppl_ratio``,
    ``chi2_token`` (E[rho^2] - 1 per token) and ``chi2_seq`` (E[(prod rho)^2] - 1 per
    sequence), rho = pi_train / pi_rollout. Perplexities are per-sequence, then averaged over
    the ``B`` rows (as verl does, rows with no token count with log-ppl 0)."""
    if not mask.any():
        raise ValueError("mismatch_metrics needs at least one token in the mask")
    train_lp = masked_mean(policy_logprob, mask, -1)
    metrics = {
        "training_ppl": float(torch.exp(-train_lp).mean()),
        "training_log_ppl": float((-train_lp).mean()),
    }
    if rollout_logprob is None:
        return metrics
    log_ratio = policy_logprob - rollout_logprob
    rollout_lp = masked_mean(rollout_logprob, mask, -1)
    diff = rollout_lp - train_lp
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log_ratio = masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics.update(
        {
            "kl": float(masked_mean(-log_ratio, mask)),
            "k3_kl": float(masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)),
            "rollout_ppl": float(torch.exp(-rollout_lp).mean()),
            "rollout_log_ppl": float((-rollout_lp).mean()),
            "log_ppl_diff": float(diff.mean()),
            "log_ppl_abs_diff": float(diff.abs().mean()),
            "log_ppl_diff_max": float(diff.max()),
            "log_ppl_diff_min": float(diff.min()),
            "ppl_ratio": float(torch.exp(diff).mean()),
            "chi2_token": float(masked_mean(rho.square(), mask) - 1.0),
            "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
        }
    )
    return metrics


def is_weight_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """``rollout_is_*`` statistics of applied ``weights`` and ``raw`` (before truncation or
    IcePop) weights. ``log_ratio`` is ``[B, T]`` (token level) or the per-sequence sum
    ``[B, 1]`` (sequence level). ``lower`` None = ``1/upper`` for the low fractions."""
    if not mask.any():
        raise ValueError("is_weight_metrics needs at least one token in the mask")
    low = 1.0 / upper if lower is None else lower
    log_upper, log_lower = torch.log(torch.tensor(upper)), torch.log(torch.tensor(low))
    m: dict[str, float] = {"rollout_is_mean": float(masked_mean(weights, mask))}
    if level == "sequence":
        m["rollout_is_max"] = float(torch.exp(log_ratio.max().clamp(max=SAFETY_BOUND)))
        m["rollout_is_min"] = float(torch.exp(log_ratio.min()))
        m["rollout_is_ratio_fraction_high"] = float((log_ratio > log_upper).float().mean())
        m["rollout_is_ratio_fraction_low"] = float((log_ratio < log_lower).float().mean())
    else:
        m["rollout_is_ratio_fraction_high"] = float(masked_mean((raw > upper).float(), mask))
        m["rollout_is_ratio_fraction_low"] = float(masked_mean((raw < low).float(), mask))
        m["rollout_is_max"] = _masked_max(weights, mask)
        m["rollout_is_min"] = _masked_min(weights, mask)
    m["rollout_is_std"] = clamped_std(weights, mask, 0.0, upper)
    m["rollout_is_eff_sample_size"] = effective_sample_size(weights.clamp(0.0, upper), mask)
    m.update(_is_sequence_metrics(weights, raw, mask, upper, low))
    return m


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 / E[(w / E[w])^2]`` over the masked tokens: 1 for equal weights, small when a few
    tokens carry the batch; 0 when every weight is 0 (IcePop zeroed them all: verl divides
    by zero there)."""
    normalized = weights / (masked_mean(weights, mask) + 1e-8)
    second_moment = float(masked_mean(normalized.square(), mask))
    return 1.0 / second_moment if second_moment else 0.0


def _is_sequence_metrics(weights, raw, mask, upper: float, low: float) -> dict[str, float]:
    """Per-sequence mean weights (over all ``B`` rows): spread, and the fractions whose raw
    mean is out of bounds."""
    seq = masked_mean(weights, mask, -1)
    raw_seq = masked_mean(raw, mask, -1)
    return {
        "rollout_is_seq_mean": float(seq.mean()),
        "rollout_is_seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
        "rollout_is_seq_max": float(seq.max()),
        "rollout_is_seq_min": float(seq.min()),
        "rollout_is_seq_max_deviation": float((seq - 1.0).abs().max()),
        "rollout_is_seq_fraction_high": float((raw_seq > upper).float().mean()),
        "rollout_is_seq_fraction_low": float((raw_seq < low).float().mean()),
    }


def rejection_metrics(
    option: str,
    stat: torch.Tensor,
    mask: torch.Tensor,
    seq_stat: torch.Tensor | None,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """``rollout_rs_<option>_*`` statistics of one rejection criterion. ``stat`` is the
    per-token statistic ``[B, T]`` (a sequence criterion's value repeated over its tokens),
    ``seq_stat`` the per-sequence one ``[B]`` (None for token criteria: then the token mean);
    ``upper``/``lower`` are the bounds ``stat`` is compared with (log-ratio bounds for k1,
    ``lower`` None for k2/k3, whose fractions below are 0)."""
    if not mask.any():
        raise ValueError("rejection_metrics needs at least one token in the mask")
    prefix = f"rollout_rs_{option}"
    per_seq = masked_mean(stat, mask, -1) if seq_stat is None else seq_stat
    valid = per_seq[mask.sum(-1) > 0]
    on_tokens = seq_stat is None
    high = (stat > upper).float() if on_tokens else (valid > upper).float()
    m = {
        f"{prefix}_mean": float(masked_mean(stat, mask)),
        f"{prefix}_max": _masked_max(stat, mask) if on_tokens else float(valid.max()),
        f"{prefix}_min": _masked_min(stat, mask) if on_tokens else float(valid.min()),
        f"{prefix}_fraction_high": float(masked_mean(high, mask) if on_tokens else high.mean()),
        f"{prefix}_fraction_low": 0.0,
        f"{prefix}_std": clamped_std(stat, mask, 0.0 if lower is None else lower, upper),
        f"{prefix}_seq_mean": float(valid.mean()),
        f"{prefix}_seq_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        f"{prefix}_seq_max": float(valid.max()),
        f"{prefix}_seq_min": float(valid.min()),
        f"{prefix}_seq_max_deviation": float(valid.abs().max()),
        f"{prefix}_seq_fraction_high": float((valid > upper).float().mean()),
    }
    if lower is not None:
        low = (stat < lower).float() if on_tokens else (valid < lower).float()
        m[f"{prefix}_fraction_low"] = float(masked_mean(low, mask) if on_tokens else low.mean())
        m[f"{prefix}_seq_fraction_low"] = float((valid < lower).float().mean())
    return m


def prefixed(metrics: dict[str, float]) -> dict[str, float]:
    """verl's logging names: every correction metric under ``rollout_corr/``."""
    return {f"rollout_corr/{name}": value for name, value in metrics.items()}
