"""Hand-computed checks of the trainer's RL math (services/rl/core_algos.py).

Every expected number is written out here and was worked out by hand from the formulas, so a
test fails if the implementation drifts from the papers, not just if it changes.
"""

import math
from typing import get_args

import pytest
import torch

from rlfleet.common.config import AlgorithmConfig
from rlfleet.rl import advantages as adv_mod
from rlfleet.rl import core_algos as ca


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=0)


# --- masked reductions ----------------------------------------------------------------------


def test_masked_sum_and_mean_ignore_padding() -> None:
    x, mask = t([[1, 2, 100], [3, 100, 100]]), t([[1, 1, 0], [1, 0, 0]])
    close(ca.masked_sum(x, mask), 6.0)
    close(ca.masked_mean(x, mask), 2.0)
    close(ca.masked_mean(x, mask, dim=-1), [1.5, 3.0])


def test_masked_mean_of_empty_mask_is_zero_not_nan() -> None:
    close(ca.masked_mean(t([5.0, 7.0]), t([0, 0])), 0.0)


def test_masked_whiten_uses_masked_stats_and_zeroes_padding() -> None:
    # values 1, 2, 3 -> mean 2, unbiased std 1 -> -1, 0, 1; the 50 is padding.
    out = ca.masked_whiten(t([[1, 2], [3, 50]]), t([[1, 1], [1, 0]]))
    close(out, [[-1, 0], [1, 0]])


# --- outcome advantages ---------------------------------------------------------------------

# Two groups, interleaved: "a" = [1, 0, 1, 0], "b" = [1, 1, 1, 1]. Reward sits on the last real
# token; sequence 1 has one padded token carrying a stray reward that must be ignored.
REWARDS = t([[0, 1], [0, 1], [0, 0], [1, 9], [1, 0], [0, 1], [0, 0], [0, 1]])
MASK = t([[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1], [1, 1]])
GROUPS = ["a", "b", "a", "b", "a", "b", "a", "b"]


def test_grpo_two_groups_hand_computed() -> None:
    # group a: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 / (0.5773503 + 1e-6) = +-0.8660239
    # group b: all equal -> std 0 -> advantage 0
    adv, ret = adv_mod.grpo_outcome_advantage(REWARDS, MASK, GROUPS)
    a = 0.8660239
    close(adv, [[a, a], [0, 0], [-a, -a], [0, 0], [a, a], [0, 0], [-a, -a], [0, 0]])
    close(ret, adv.tolist())


def test_grpo_without_std_norm_is_mean_baseline() -> None:
    adv, _ = adv_mod.grpo_outcome_advantage(REWARDS, MASK, GROUPS, norm_by_std=False)
    close(adv[:, 0], [0.5, 0, -0.5, 0, 0.5, 0, -0.5, 0])


def test_grpo_accepts_tensor_group_index_and_masks_padding() -> None:
    rewards, mask = t([[0, 2, 0], [0, 0, 0]]), t([[1, 1, 0], [1, 1, 1]])
    adv, _ = adv_mod.grpo_outcome_advantage(rewards, mask, torch.tensor([7, 7]))
    # scores 2 and 0: mean 1, unbiased std sqrt(2) -> +-1/1.4142146
    close(adv, [[0.7071064, 0.7071064, 0], [-0.7071064, -0.7071064, -0.7071064]])


def test_grpo_singleton_group_keeps_raw_score() -> None:
    adv, _ = adv_mod.grpo_outcome_advantage(t([[0, 3]]), t([[1, 1]]), ["solo"])
    close(adv, [[3 / (1 + 1e-6), 3 / (1 + 1e-6)]])


def test_rloo_leave_one_out_hand_computed() -> None:
    # group a: a 1 is compared with mean(1, 0, 0) = 1/3 -> 2/3; a 0 with mean(1, 1, 0) -> -2/3.
    adv, _ = adv_mod.rloo_outcome_advantage(REWARDS, MASK, GROUPS)
    close(adv[:, 1], [2 / 3, 0, -2 / 3, 0, 2 / 3, 0, -2 / 3, 0])
    close(adv[3], [0, 0])  # padding of sequence 3 stays zero


def test_rloo_singleton_group_keeps_raw_score() -> None:
    adv, _ = adv_mod.rloo_outcome_advantage(t([[0, 5]]), t([[1, 1]]), [0])
    close(adv, [[5, 5]])


# --- token-level advantages -----------------------------------------------------------------


def test_reinforce_plus_plus_discounts_then_whitens() -> None:
    rewards, mask = t([[0, 0, 1], [0, 2, 7]]), t([[1, 1, 1], [1, 1, 0]])
    adv, ret = adv_mod.reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    # returns: row 0 = 0.25, 0.5, 1; row 1 = 1, 2, (pad) 0.
    close(ret, [[0.25, 0.5, 1], [1, 2, 0]])
    # mean 0.95, unbiased std sqrt(0.45) = 0.6708204
    close(adv, [[-1.0434984, -0.6708204, 0.0745356], [0.0745356, 1.5652476, 0]])


def test_gae_hand_computed_and_padding_value_does_not_leak() -> None:
    rewards = t([[0, 1], [2, 0]])
    values = t([[0.2, 0.5], [1.0, 7.0]])  # 7.0 sits on padding and must not be used
    mask = t([[1, 1], [1, 0]])
    adv, ret = adv_mod.gae_advantage(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: t=1 delta = 1 - 0.5 = 0.5; t=0 delta = 0.9*0.5 - 0.2 = 0.25, A = 0.25 + 0.72*0.5
    #        = 0.61; returns = A + V = 0.81, 1.0.  row 1: t=0 delta = 2 - 1 = 1, return 2.
    close(ret, [[0.81, 1.0], [2.0, 0]])
    # whitening 0.61, 0.5, 1.0: mean 0.7033333, unbiased std 0.2627420
    close(adv, [[-0.3552281, -0.7738899], [1.1291180, 0]])


def test_gae_accepts_bool_mask() -> None:
    rewards, values = t([[0, 1], [2, 0]]), t([[0.2, 0.5], [1.0, 7.0]])
    as_float = adv_mod.gae_advantage(rewards, values, t([[1, 1], [1, 0]]), gamma=0.9, lam=0.8)
    as_bool = adv_mod.gae_advantage(rewards, values, as_float[1] != 0, gamma=0.9, lam=0.8)
    close(as_bool[0], as_float[0].tolist())
    close(as_bool[1], as_float[1].tolist())


def test_compute_advantage_dispatches_by_name() -> None:
    inputs = adv_mod.AdvantageInputs(
        token_level_rewards=t([[1.0], [0.0]]), response_mask=t([[1], [1]]), group_index=[0, 0]
    )
    adv, _ = adv_mod.compute_advantage(adv_mod.AdvantageParams(estimator="rloo"), inputs)
    close(adv, [[1.0], [-1.0]])
    assert set(adv_mod.ESTIMATORS) == set(get_args(adv_mod.EstimatorName))
    config_names = get_args(AlgorithmConfig.model_fields["adv_estimator"].annotation)
    assert set(adv_mod.ESTIMATORS) == set(config_names)


def test_compute_advantage_unknown_name_lists_valid_ones() -> None:
    inputs = adv_mod.AdvantageInputs(token_level_rewards=t([[1.0]]), response_mask=t([[1]]))
    valid = "gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, rloo"
    with pytest.raises(ValueError, match=valid):
        adv_mod.compute_advantage(adv_mod.AdvantageParams(estimator="ppo-magic"), inputs)


def test_compute_advantage_names_the_missing_input() -> None:
    inputs = adv_mod.AdvantageInputs(token_level_rewards=t([[1.0]]), response_mask=t([[1]]))
    with pytest.raises(ValueError, match="gae.*critic values"):
        adv_mod.compute_advantage(adv_mod.AdvantageParams(estimator="gae"), inputs)


# --- KL -------------------------------------------------------------------------------------


def test_kl_estimators_hand_computed() -> None:
    # p = 0.5, q = 0.25: k1 = ln 2; k2 = 0.5 ln^2 2; k3 = q/p - 1 - ln(q/p) = 0.5 - 1 + ln 2
    logp, ref = t([[math.log(0.5)]]), t([[math.log(0.25)]])
    close(ca.kl_penalty(logp, ref, "k1"), [[0.6931472]])
    close(ca.kl_penalty(logp, ref, "k2"), [[0.2402265]])
    close(ca.kl_penalty(logp, ref, "k3"), [[0.1931472]])
    close(ca.kl_penalty(logp, ref, "low_var_kl"), [[0.1931472]])


def test_low_var_kl_is_clamped_where_k3_explodes() -> None:
    logp, ref = t([[-30.0]]), t([[0.0]])
    assert ca.kl_penalty(logp, ref, "k3").item() > 1e12
    close(ca.kl_penalty(logp, ref, "low_var_kl"), [[10.0]])


def test_kl_unknown_kind_raises() -> None:
    with pytest.raises(ValueError, match="k3"):
        ca.kl_penalty(t([[0.0]]), t([[0.0]]), "k9")  # type: ignore[arg-type]


# --- loss aggregation -----------------------------------------------------------------------


def test_agg_loss_modes_hand_computed() -> None:
    # third row has no tokens: it must not count as a sequence in the seq-mean modes
    loss, mask = t([[1, 2, 3], [4, 50, 50], [9, 9, 9]]), t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(ca.agg_loss(loss, mask, "token-mean"), 2.5)  # (1+2+3+4)/4
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum"), 5.0)  # (6+4)/2
    close(ca.agg_loss(loss, mask, "seq-mean-token-mean"), 3.0)  # (2+4)/2
    with pytest.raises(ValueError):
        ca.agg_loss(loss, mask, "sum")  # type: ignore[arg-type]


# --- PPO policy loss ------------------------------------------------------------------------


def test_ppo_clip_values_hand_computed() -> None:
    old = t([[0.0, 0.0, 0.0, 0.0]])
    new = t([[math.log(1.5), math.log(0.5), math.log(1.1), 5.0]])
    adv, mask = t([[1.0, 1.0, -2.0, 100.0]]), t([[1, 1, 1, 0]])
    out = ca.policy_loss_ppo_clip(old, new, adv, mask)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5;
    # token 2: max(2.2, 2.2) = 2.2; token 3 is padding.
    close(out.pg_loss, 0.1666667)  # (-1.2 - 0.5 + 2.2) / 3
    close(out.pg_clipfrac, 1 / 3)
    close(out.ppo_kl, 0.0641240)  # -(ln 1.5 + ln 0.5 + ln 1.1) / 3


def _grad_of_logprob(ratio: float, advantage: float, **clip) -> float:
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = ca.policy_loss_ppo_clip(t([[0.0]]), logp, t([[advantage]]), t([[1.0]]), **clip)
    out.pg_loss.backward()
    return logp.grad.item()


def test_ppo_ratio_above_clip_with_positive_advantage_has_zero_gradient() -> None:
    assert _grad_of_logprob(1.5, 1.0) == 0.0
    assert _grad_of_logprob(0.5, -1.0) == 0.0  # symmetric case below 1 - eps


def test_ppo_ratio_above_clip_with_negative_advantage_still_pushes_down() -> None:
    # loss = -A * r = r, d/dlogp = r = 1.5
    assert _grad_of_logprob(1.5, -1.0) == pytest.approx(1.5)


def test_ppo_clip_higher_bound_is_separate() -> None:
    # ratio 1.25 is clipped at the default 1.2 but not with clip_ratio_high = 0.28 (DAPO)
    assert _grad_of_logprob(1.25, 1.0) == 0.0
    assert _grad_of_logprob(1.25, 1.0, clip_ratio_high=0.28) == pytest.approx(-1.25)


def test_ppo_padding_gets_no_gradient() -> None:
    logp = torch.zeros(1, 2, requires_grad=True)
    ca.policy_loss_ppo_clip(t([[0, 0]]), logp, t([[1, 1]]), t([[1, 0]])).pg_loss.backward()
    close(logp.grad, [[-1.0, 0.0]])


# --- value loss -----------------------------------------------------------------------------


def test_value_loss_clipped_hand_computed() -> None:
    vpreds, old, returns = t([[1.0, 0.3, 9.0]]), t([[0.0, 0.0, 0.0]]), t([[2.0, 0.0, 0.0]])
    loss, clipfrac = ca.value_loss_clipped(vpreds, old, returns, t([[1, 1, 0]]))
    # token 0: clipped pred 0.5 -> max(1, 2.25) = 2.25 (clipped); token 1: 0.09 both.
    close(loss, 0.585)  # 0.5 * (2.25 + 0.09) / 2
    close(clipfrac, 0.5)


# --- logits helpers -------------------------------------------------------------------------


def test_entropy_from_logits_hand_computed() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e9, -1e9]]])
    # uniform over 4 -> ln 4; p = (0.25, 0.75) -> 0.5623351
    close(ca.entropy_from_logits(logits), [[1.3862944, 0.5623351]])


def test_logprobs_from_logits_hand_computed() -> None:
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    out = ca.logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    close(out, [[math.log(0.75), math.log(0.25)]])  # -0.2876821, -1.3862944


def test_logprobs_from_bf16_logits_match_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=gen).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 3), generator=gen)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(ca.logprobs_from_logits(logits, labels), expected)
