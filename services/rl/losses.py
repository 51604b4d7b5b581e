"""The actor's loss as one typed entry: PPO clipped surrogate + KL to the reference + entropy,
with an optional off-policy correction for responses sampled by older weights.

``actor_loss(params, inputs)`` is what the actor calls; it knows nothing of which advantage
estimator ran or whether training is synchronous. Shapes: ``B`` sequences, ``T`` response
tokens, ``V`` vocabulary; ``response_mask`` is 1 on real response tokens.

Off-policy correction (asynchronous training): the engine that sampled a response held weights
``k`` versions old, so its behaviour log-probs differ from the proximal policy's (the weights
the update starts from, ``old_logprob``). Following AReaL's decoupled PPO objective (Fu et al.
2025, arXiv:2505.24298), the clipped surrogate is taken against the proximal policy and each
token is weighted by ``pi_prox / pi_behav``, truncated at ``is_cap`` (truncated importance
sampling, Espeholt et al. 2018, IMPALA, arXiv:1802.01561). With fresh responses the weight is 1
and the loss is plain PPO (Schulman et al. 2017, arXiv:1707.06347). The KL term follows GRPO
(Shao et al. 2024, arXiv:2402.03300).

``policy_loss_mode`` picks the surrogate: ``vanilla`` is token-level PPO with dual clip (Ye et
al. 2020, arXiv:1912.09729), ``gspo`` the sequence-level ratio of GSPO (Zheng et al. 2025,
arXiv:2507.18071); see ``rlfleet.rl.core_algos``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from rlfleet.rl import core_algos
from rlfleet.rl.core_algos import KLKind, LossAggMode
from rlfleet.rl.rollout_correction import CorrectionParams, correct, reinforce_loss
from rlfleet.rl.rollout_correction_metrics import mismatch_metrics, prefixed

PolicyLossMode = Literal["vanilla", "gspo"]

TOKEN_MEAN_METRICS = frozenset(
    {
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "async/importance_weight/mean",
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/chi2_token",
    }
)
"""``actor_loss`` metrics that are means over the tokens whatever ``loss_agg_mode`` says (the
losses follow the mode; ``/max`` ones are maxima): what a mini-batch's metrics are weighted by
when they are put together from micro-batches or data-parallel shards."""


@dataclass(frozen=True)
class LossParams:
    """Knobs of the actor loss (from ``trainer.*`` in the config)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: LossAggMode = "token-mean"
    kl_coef: float = 0.0
    """Weight of KL(actor || reference); 0 = no reference needed."""
    kl_type: KLKind = "low_var_kl"
    entropy_coeff: float = 0.0
    is_cap: float = 2.0
    """Upper bound of the per-token importance weight pi_prox / pi_behav."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip floor for negative advantages (> 1; None = off). Vanilla mode only."""
    policy_loss_mode: PolicyLossMode = "vanilla"
    """``vanilla``: token-level ratio; ``gspo``: sequence-level ratio."""
    loss_scale_factor: float | None = None
    """Constant horizon of ``seq-mean-token-sum-norm`` (the max response length); None = the
    mask width, which varies with the mini-batch's longest response."""
    correction: CorrectionParams | None = None
    """``algorithm.rollout_correction`` when it is on. Decoupled mode only needs it to be
    set (its weights and mask come with the inputs); bypass mode runs it in the loss."""

    @property
    def effective_agg_mode(self) -> LossAggMode:
        """The aggregation the policy loss really uses (GSPO fixes seq-mean-token-mean)."""
        return "seq-mean-token-mean" if self.policy_loss_mode == "gspo" else self.loss_agg_mode


@dataclass
class LossInputs:
    """Tensors for one mini-batch; all ``[B, T]`` except ``logits`` ``[B, T, V]``."""

    logits: torch.Tensor
    logprob: torch.Tensor
    old_logprob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    ref_logprob: torch.Tensor | None = None
    behaviour_logprob: torch.Tensor | None = None
    """Log-probs the sampling engine reported; None = the response is on-policy."""
    rollout_logprob: torch.Tensor | None = None
    """The engine's log-probs, when the loss measures the mismatch itself (``rollout_corr/*``
    from this forward) or runs the bypass mode's correction."""
    rollout_is_weights: torch.Tensor | None = None
    """Decoupled rollout correction's weights (``rlfleet.rl.rollout_correction.correct``),
    multiplied into the per-token policy loss."""
    entropy: torch.Tensor | None = None
    """Per-token entropy already computed with the log-probs (``label_logprobs``, no gradient);
    None = computed here from ``logits``."""


def importance_weights(
    old_logprob: torch.Tensor, behaviour_logprob: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated per-token weights ``min(exp(old - behav), cap)``, detached, ``[B, T]``."""
    log_w = (old_logprob - behaviour_logprob).clamp(-20, 20)
    return torch.exp(log_w).clamp(max=cap).detach()


def policy_loss(
    params: LossParams, x: LossInputs, weights: torch.Tensor | None
) -> core_algos.PolicyLossOutput:
    """The surrogate named by ``params.policy_loss_mode``."""
    low, high = params.clip_ratio_low, params.clip_ratio_high
    if params.policy_loss_mode == "gspo":
        return core_algos.policy_loss_gspo(
            x.old_logprob, x.logprob, x.advantages, x.response_mask, low, high, weights
        )
    if params.policy_loss_mode != "vanilla":
        raise ValueError(
            f"unknown policy_loss_mode {params.policy_loss_mode!r}; valid: vanilla, gspo"
        )
    return core_algos.policy_loss_ppo_clip(
        x.old_logprob,
        x.logprob,
        x.advantages,
        x.response_mask,
        low,
        high,
        params.loss_agg_mode,
        token_weights=weights,
        clip_ratio_c=params.clip_ratio_c,
        loss_scale_factor=params.loss_scale_factor,
    )


def actor_loss(params: LossParams, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss to backprop and verl-named metrics for one mini-batch."""
    mask = x.response_mask
    weights = None
    metrics: dict[str, float] = {}
    if x.behaviour_logprob is not None:
        weights = importance_weights(x.old_logprob, x.behaviour_logprob, params.is_cap)
        metrics["async/importance_weight/mean"] = core_algos.masked_mean(weights, mask).item()
        metrics["async/importance_weight/max"] = float((weights * mask).max())
    if x.rollout_is_weights is not None:
        weights = x.rollout_is_weights
    bypass = params.correction is not None and params.correction.bypass_mode
    if bypass and x.rollout_logprob is not None:
        out, corr_metrics = bypass_policy_loss(params, x)
        metrics.update(corr_metrics)
    else:
        out = policy_loss(params, x, weights)
        metrics.update(measured_mismatch(x))
    loss = out.pg_loss
    metrics.update(
        {
            "actor/pg_loss": out.pg_loss.item(),
            "actor/pg_clipfrac": out.pg_clipfrac.item(),
            "actor/ppo_kl": out.ppo_kl.item(),
        }
    )
    if out.pg_clipfrac_lower is not None:
        metrics["actor/pg_clipfrac_lower"] = out.pg_clipfrac_lower.item()
    mode, scale = params.effective_agg_mode, params.loss_scale_factor
    if params.kl_coef and x.ref_logprob is not None:
        kl = core_algos.kl_penalty(x.logprob, x.ref_logprob, params.kl_type)
        kl_loss = core_algos.agg_loss(kl, mask, mode, scale)
        loss = loss + params.kl_coef * kl_loss
        metrics["actor/kl_loss"] = kl_loss.item()
    entropies = (
        x.entropy if x.entropy is not None else token_entropy(x.logits, bool(params.entropy_coeff))
    )
    entropy = core_algos.agg_loss(entropies, mask, mode, scale)
    if params.entropy_coeff:
        loss = loss - params.entropy_coeff * entropy
    metrics["actor/entropy"] = entropy.item()
    return loss, metrics


def measured_mismatch(x: LossInputs) -> dict[str, float]:
    """``rollout_corr/*`` mismatch metrics of this forward's (detached) log-probs against the
    engine's, when the inputs carry them and the mask holds a token."""
    if x.rollout_logprob is None or not x.response_mask.any():
        return {}
    logprob = x.logprob.detach()
    return prefixed(mismatch_metrics(logprob, x.rollout_logprob, x.response_mask))


def bypass_policy_loss(
    params: LossParams, x: LossInputs
) -> tuple[core_algos.PolicyLossOutput, dict[str, float]]:
    """verl's bypass mode: the engine's log-probs are the old policy. The weights and the
    rejection mask come from the current policy against the engine's (``correct``, no
    grad); ``ppo_clip`` then runs the usual surrogate with the ratio pi / pi_rollout and no
    extra weights, ``reinforce`` the weighted REINFORCE loss. Rejected tokens leave the
    policy loss only (KL and entropy keep the full mask, as in verl)."""
    corr = params.correction
    assert corr is not None and x.rollout_logprob is not None
    if not x.response_mask.any():
        return policy_loss(params, replace(x, old_logprob=x.rollout_logprob), None), {}
    with torch.no_grad():
        fix = correct(x.logprob.detach(), x.rollout_logprob, x.response_mask, corr)
    if corr.loss_type == "ppo_clip":
        inputs = replace(x, old_logprob=x.rollout_logprob, response_mask=fix.mask)
        return policy_loss(params, inputs, None), fix.metrics
    if corr.loss_type != "reinforce":
        raise ValueError(f"unknown loss_type {corr.loss_type!r}; valid: ppo_clip, reinforce")
    loss, ppo_kl = reinforce_loss(
        x.logprob,
        x.rollout_logprob,
        x.advantages,
        fix.mask,
        params.effective_agg_mode,
        fix.weights,
        params.loss_scale_factor,
    )
    return core_algos.PolicyLossOutput(loss, torch.zeros(()), ppo_kl), fix.metrics


def token_entropy(logits: torch.Tensor, with_grad: bool) -> torch.Tensor:
    """Per-token entropy, ``[B, T]``. Without a bonus in the loss it is a metric only, so it
    runs without grad: the same values, and no graph holding its ``[B, T, V]`` softmax. Not
    one row at a time as well: on SmolLM2 that measured no lower peak RSS (the peak is the
    backward's, once these temporaries are gone); micro-batches are what bound them."""
    if with_grad:
        return core_algos.entropy_from_logits(logits)
    with torch.no_grad():
        return core_algos.entropy_from_logits(logits)
