"""The actor's loss entry (rlfleet.rl.losses) on hand-computed cases."""

import math

import pytest
import torch

from rlfleet.rl.losses import LossInputs, LossParams, actor_loss, importance_weights


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def inputs(**overrides) -> LossInputs:
    """One sequence, two tokens, uniform logits over 2 symbols (entropy log 2 per token)."""
    base = dict(
        logits=torch.zeros(1, 2, 2),
        logprob=t([[0.0, 0.0]]),
        old_logprob=t([[0.0, 0.0]]),
        advantages=t([[1.0, 1.0]]),
        response_mask=t([[1.0, 1.0]]),
    )
    base.update(overrides)
    return LossInputs(**base)


def test_importance_weights_are_truncated_ratios() -> None:
    # exp(0 - log 0.5) = 2 -> capped at 1.5; exp(log .5 - 0) = 0.5 kept.
    w = importance_weights(t([[0.0, math.log(0.5)]]), t([[math.log(0.5), 0.0]]), cap=1.5)
    assert w[0].tolist() == pytest.approx([1.5, 0.5])


def test_on_policy_loss_is_minus_mean_advantage() -> None:
    loss, metrics = actor_loss(LossParams(), inputs())
    # ratio 1 everywhere: loss = -mean(A) = -1; no KL, no importance metrics
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["actor/entropy"] == pytest.approx(math.log(2))
    assert "actor/kl_loss" not in metrics and "async/importance_weight/mean" not in metrics


def test_behaviour_logprobs_weight_each_token() -> None:
    # Token 1 was sampled by a policy that gave it half the probability: weight 2 (cap 3).
    behav = t([[math.log(0.5), 0.0]])
    loss, metrics = actor_loss(LossParams(is_cap=3.0), inputs(behaviour_logprob=behav))
    # per-token losses -2 and -1, token-mean -> -1.5
    assert loss.item() == pytest.approx(-1.5)
    assert metrics["async/importance_weight/mean"] == pytest.approx(1.5)
    assert metrics["async/importance_weight/max"] == pytest.approx(2.0)


def test_kl_term_only_with_a_coefficient() -> None:
    ref = t([[math.log(0.5), math.log(0.5)]])
    _, without = actor_loss(LossParams(kl_coef=0.0), inputs(ref_logprob=ref))
    loss, with_kl = actor_loss(LossParams(kl_coef=0.5, kl_type="k1"), inputs(ref_logprob=ref))
    assert "actor/kl_loss" not in without
    # k1 = logp - ref = log 2 per token; loss = -1 + 0.5 * log 2
    assert with_kl["actor/kl_loss"] == pytest.approx(math.log(2))
    assert loss.item() == pytest.approx(-1.0 + 0.5 * math.log(2))


def test_entropy_bonus_lowers_the_loss() -> None:
    loss, _ = actor_loss(LossParams(entropy_coeff=0.1), inputs())
    assert loss.item() == pytest.approx(-1.0 - 0.1 * math.log(2))
