"""RL math below every role: KL penalties, policy and value losses, masked reductions.

Advantage estimators live in ``rlfleet.rl.advantages``; the actor's whole loss in
``rlfleet.rl.losses``.

Everything here is a pure function over torch tensors, so the controller stays blind to the
algorithm and each piece can be checked on a tiny hand-computed case. Shapes: ``B`` sequences,
``T`` response tokens, ``V`` vocabulary. ``response_mask`` is 1 on real response tokens and 0 on
padding; outputs are zero outside the mask unless a docstring says otherwise.

Sources:
- GRPO group-normalised outcome advantage: Shao et al. 2024, DeepSeekMath, arXiv:2402.03300.
- PPO clipped surrogate and clipped value loss: Schulman et al. 2017, arXiv:1707.06347.
- GAE: Schulman et al. 2015, arXiv:1506.02438.
- RLOO leave-one-out baseline: Ahmadian et al. 2024, arXiv:2402.14740.
- REINFORCE++ (discounted return, batch-whitened): Hu 2025, arXiv:2501.03262.
- Token-level loss aggregation ("token-mean"): Yu et al. 2025, DAPO, arXiv:2503.14476.
- k1/k2/k3 KL estimators: J. Schulman 2020, "Approximating KL divergence" (blog post);
  ``low_var_kl`` is k3 clamped to [-10, 10], the variant verl uses for the KL loss.
- Dual-clip PPO (a floor on the loss of negative-advantage tokens): Ye et al. 2020, "Mastering
  Complex Control in MOBA Games with Deep RL", arXiv:1912.09729.
- GSPO (sequence-level importance ratio): Zheng et al. 2025, arXiv:2507.18071.
- "seq-mean-token-sum-norm" (token sum over a constant horizon): Dr. GRPO, Liu et al. 2025,
  arXiv:2503.20783.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KLKind = Literal["k1", "k2", "k3", "low_var_kl", "kl", "mse", "abs"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
_KL_ALIASES: dict[str, KLKind] = {"kl": "k1", "mse": "k2"}
"""verl's names for the same estimators (``algorithm.kl_penalty: kl`` is k1)."""


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is set, over ``dim`` (all dims when None)."""
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over masked entries; an empty mask gives 0 rather than NaN."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1e-8)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shift ``x`` to mean 0 and scale to unit unbiased std, with statistics over the mask only.

    Padding must not move the statistics, so they come from masked entries; the result is zeroed
    outside the mask so padding never carries a value into a loss. Shape is that of ``x``.
    """
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / (count - 1).clamp_min(1)
    return (x - mean) * torch.rsqrt(var + 1e-8) * mask


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled log-probs, [B, T].

    k1 = log p - log q (unbiased, high variance, can be negative); k2 = 0.5 * k1^2;
    k3 = q/p - 1 - log(q/p) (unbiased, always >= 0). ``low_var_kl`` is k3 with the log-ratio
    clamped to [-20, 20] before exp and the result to [-10, 10], so one outlier token cannot
    blow up the loss. verl's names work too: ``kl`` = k1, ``mse`` = k2, ``abs`` = |k1|.
    Not masked: the caller aggregates with its mask.
    """
    log_ratio = logprob - ref_logprob
    kind = _KL_ALIASES.get(kind, kind)
    if kind == "abs":
        return log_ratio.abs()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if kind == "low_var_kl":
        neg = (-log_ratio).clamp(-20, 20)
        return (torch.exp(neg) - 1 - neg).clamp(-10, 10)
    raise ValueError(f"unknown KL kind {kind!r}; valid: k1, k2, k3, low_var_kl, kl, mse, abs")


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token-mean: every token weighs the same (DAPO), so long answers are not down-weighted.
    seq-mean-token-sum / seq-mean-token-mean: per-sequence sum or mean, then the mean over
    sequences that have at least one token.
    seq-mean-token-sum-norm (Dr. GRPO, verl): the sum over every token of the batch divided by
    a constant horizon, ``loss_scale_factor`` (the max response length; the mask width when
    None), so neither the response length nor the number of live tokens rescales the gradient.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, mask) / (loss_scale_factor or mask.shape[-1])
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}")
    return masked_mean(per_seq, (mask.sum(-1) > 0).to(loss_mat.dtype))


@dataclass
class PolicyLossOutput:
    """Scalar outputs of a policy loss: the loss to backprop and diagnostics."""

    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    pg_clipfrac_lower: torch.Tensor | None = None
    """Share of tokens held by the dual-clip floor (negative advantages only)."""


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token pessimistic PPO loss, [B, T]; returns (losses, clipped, floored) masks too.

    The ratio is clipped to [1 - low, 1 + high] and the larger loss is kept. Dual clip (Ye et
    al. 2020): with a negative advantage the clipped loss -A * r grows without bound in r, so
    one token whose probability exploded can dominate the batch; its loss is capped at
    -A * clip_ratio_c (``clip_ratio_c`` > 1; None = no floor). Positive advantages are untouched.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    floored = torch.zeros_like(was_clipped)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        floored = (losses > cap) & (advantages < 0)
        losses = torch.where(advantages < 0, torch.minimum(losses, cap), losses)
    return losses, was_clipped, floored


def policy_loss_ppo_clip(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: LossAggMode = "token-mean",
    token_weights: torch.Tensor | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_scale_factor: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with per-token ratios, dual-clipped; all inputs [B, T].

    Separate bounds allow DAPO's clip-higher; a token that already moved past the bound in the
    advantage's direction contributes no gradient (see ``clipped_surrogate``). ``ppo_kl`` is
    mean(old - new log-prob). ``token_weights`` (detached, [B, T]) scale each token's loss:
    importance weights for responses sampled by an older policy (``rlfleet.rl.losses``).
    """
    log_ratio = (logprob - old_logprob).clamp(-20, 20)  # keeps exp finite for stale tokens
    losses, clipped, floored = clipped_surrogate(
        torch.exp(log_ratio), advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    if token_weights is not None:
        losses = losses * token_weights
    return PolicyLossOutput(
        pg_loss=agg_loss(losses, response_mask, loss_agg_mode, loss_scale_factor),
        pg_clipfrac=masked_mean(clipped.float(), response_mask),
        ppo_kl=masked_mean(-log_ratio, response_mask).detach(),
        pg_clipfrac_lower=masked_mean(floored.float(), response_mask),
    )


def sequence_log_ratio(
    old_logprob: torch.Tensor, logprob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """GSPO's per-token log-ratio, [B, T]: value = the sequence's mean log-ratio, gradient =
    that token's own log-prob.

    log s_i,t = sg[mean_t(log pi - log pi_old)] + log pi_t - sg[log pi_t] (GSPO-token, Zheng et
    al. 2025, eq. 13): the same number on every token of a sequence, so the whole response is
    clipped together, while each token keeps its own gradient path.
    """
    seq_mean = masked_mean(logprob - old_logprob, response_mask, dim=-1).detach()
    return (logprob - logprob.detach() + seq_mean.unsqueeze(-1)).clamp(max=10.0)


def policy_loss_gspo(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    token_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO: PPO's clipped surrogate on the sequence-level ratio exp(mean_t log-ratio), [B, T].

    A token-level ratio is a one-sample importance weight with high variance over long answers
    (worst for MoE models); the geometric-mean ratio of the whole sequence matches the unit the
    reward is given to. As in the paper and verl, the loss is a mean per sequence then over
    sequences ("seq-mean-token-mean") whatever ``loss_agg_mode`` says, and no dual clip applies.
    The paper's bounds are tiny (3e-4 / 4e-4), since a sequence ratio moves less than a token's.
    """
    log_ratio = sequence_log_ratio(old_logprob, logprob, response_mask)
    losses, clipped, _ = clipped_surrogate(
        torch.exp(log_ratio), advantages, clip_ratio_low, clip_ratio_high
    )
    if token_weights is not None:
        losses = losses * token_weights
    return PolicyLossOutput(
        pg_loss=agg_loss(losses, response_mask, "seq-mean-token-mean"),
        pg_clipfrac=masked_mean(clipped.float(), response_mask),
        ppo_kl=masked_mean(old_logprob - logprob, response_mask).detach(),
    )


def value_loss_clipped(
    vpreds: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: LossAggMode = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * max((v - R)^2, (v_clipped - R)^2), inputs [B, T].

    The critic may move at most ``cliprange_value`` from its old prediction per update before the
    loss stops rewarding it. Returns (vf_loss scalar, vf_clipfrac scalar).
    """
    v_clipped = values_old + (vpreds - values_old).clamp(-cliprange_value, cliprange_value)
    err = (vpreds - returns).square()
    err_clipped = (v_clipped - returns).square()
    vf_loss = 0.5 * agg_loss(torch.maximum(err, err_clipped), response_mask, loss_agg_mode)
    return vf_loss, masked_mean((err_clipped > err).float(), response_mask)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax at each position: logsumexp(z) - sum(p * z). [B, T, V] -> [B, T]."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-prob of each label, [B, T, V] x [B, T] -> [B, T].

    Gathers one logit and subtracts logsumexp, so no [B, T, V] log-prob tensor is kept for
    backward. Half-precision logits go one sequence at a time through float32 log_softmax,
    because logsumexp in bf16 loses too much precision, and upcasting all rows at once would
    double the biggest tensor in the step; their result is float32.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        pairs = zip(logits, labels, strict=True)
        rows = [torch.log_softmax(z.float(), -1).gather(-1, y[:, None])[:, 0] for z, y in pairs]
        return torch.stack(rows)
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
