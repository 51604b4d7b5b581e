"""Where the trainer meets verl's rollout correction (``algorithm.rollout_correction``).

Why here: the trainer is the one place that holds both log-probs of a batch, the engine's
(``engine_logprobs``, what sampled it) and the actor's. Once per step it either corrects the
batch (decoupled mode: importance weights and a rejection mask from the actor's old
log-probs against the engine's, ``rlfleet.rl.rollout_correction.correct``) or only measures
the mismatch (``rollout_corr/kl``, ``k3_kl``, ``training_ppl``, ``chi2_*``, ...). When no
actor forward ran before the update (one optimizer step per batch, or the engine's log-probs
used as the old policy) the update's own forward measures it instead, and bypass mode
corrects in the loss (``rlfleet.rl.losses.bypass_policy_loss``): both get the engine's
log-probs through ``RolloutBatch.rollout_logprobs``. Only sampled tokens count (the mask is
the loss mask: agent mode's environment tokens and age-masked tokens are out).
"""

from __future__ import annotations

import torch

from rlfleet.common.config import RlfleetConfig
from rlfleet.rl.rollout_correction import CorrectionParams, correct
from rlfleet.rl.rollout_correction_metrics import mismatch_metrics, prefixed
from rlfleet.rl.sequences import pad_rows
from rlfleet.trainer.rollout_batch import RolloutBatch


def needs_actor_old_logprobs(config: RlfleetConfig) -> bool:
    """Decoupled correction: the old policy must be the actor's own forward (verl's three
    policies), even when one optimizer step per batch would not need one."""
    return config.algorithm.rollout_correction.decoupled


def correct_batch(
    batch: RolloutBatch, mask: torch.Tensor, config: RlfleetConfig, actor_old: bool
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss mask ``[B, T]`` to train with (rejected tokens out) and ``rollout_corr/*``
    metrics. ``actor_old``: ``batch.old_logprobs`` came from an actor forward this step.
    Sets ``batch.rollout_is_weights`` (decoupled weights) or ``batch.rollout_logprobs`` (the
    loss measures or corrects) as the case needs."""
    if not batch.engine_logprobs_complete() or not mask.any():
        return mask, {}
    corr = config.algorithm.rollout_correction
    if corr.bypass_mode or not actor_old:
        batch.rollout_logprobs = batch.engine_logprobs
        return mask, {}
    width = mask.shape[1]
    old = pad_rows(batch.old_logprobs, width)
    rollout = pad_rows(batch.engine_logprobs, width)
    if not corr.decoupled:
        return mask, prefixed(mismatch_metrics(old, rollout, mask))
    fix = correct(old, rollout, mask, CorrectionParams(**corr.model_dump(exclude={"preset"})))
    if fix.weights is not None:
        lengths = batch.response_lengths()
        batch.rollout_is_weights = [fix.weights[i, :n].tolist() for i, n in enumerate(lengths)]
    return fix.mask, fix.metrics
