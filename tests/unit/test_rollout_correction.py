"""rlfleet.rl.rollout_correction on tiny hand-computed cases, one per function (equality with
verl's own code on random batches is scripts/check_rollout_correction_parity.py's job)."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.common.config.rollout_correction import (
    RolloutCorrectionConfig,
    parse_is_threshold,
    parse_rs_thresholds,
    rs_option_list,
)
from rlfleet.rl import rollout_correction as rc
from rlfleet.rl.core_algos import policy_loss_ppo_clip
from rlfleet.rl.losses import LossInputs, LossParams, actor_loss, bypass_policy_loss
from rlfleet.rl.rollout_correction_metrics import effective_sample_size, mismatch_metrics

LN2, LN3 = math.log(2.0), math.log(3.0)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_is_threshold_is_a_number_or_lower_upper():
    assert parse_is_threshold(2.0) == (2.0, None)
    assert parse_is_threshold("2.5") == (2.5, None)
    assert parse_is_threshold("0.5_5.0") == (5.0, 0.5)
    for bad in (True, "", "x", "3_2", "0_2", -1.0):
        with pytest.raises((ValueError, TypeError)):
            parse_is_threshold(bad)


def test_rs_thresholds_per_option_and_k1_reciprocal_lower():
    assert rs_option_list("token_k1, seq_mean_k3,token_k1") == ["token_k1", "seq_mean_k3"]
    bounds = parse_rs_thresholds(["token_k1", "seq_mean_k3"], "2.0,0.01")
    assert bounds == {"token_k1": (0.5, 2.0), "seq_mean_k3": (None, 0.01)}
    assert parse_rs_thresholds(["seq_sum_k1"], "0.9_1.1") == {"seq_sum_k1": (0.9, 1.1)}
    with pytest.raises(ValueError):
        parse_rs_thresholds(["seq_mean_k3"], "0.1_2")  # k3 takes an upper bound only
    with pytest.raises(ValueError):
        parse_rs_thresholds(["token_k1", "token_k2", "token_k3"], "1,2")  # 2 specs for 3
    with pytest.raises(ValueError):
        rs_option_list("seq_max_k1")  # verl has no max of k1


def test_token_weights_truncate_and_icepop_zeroes_outside():
    log_ratio, mask = t([[LN2, math.log(4.0), 0.0]]), t([[1, 1, 0]])
    weights, metrics = rc.is_weights(log_ratio, mask, "token", 3.0)
    assert torch.allclose(weights, t([[2.0, 3.0, 0.0]]))
    assert metrics["rollout_is_mean"] == pytest.approx(2.5)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # 4 > 3
    assert metrics["rollout_is_max"] == pytest.approx(3.0)
    weights, metrics = rc.is_weights(log_ratio, mask, "token", "0.5_3")
    assert torch.allclose(weights, t([[2.0, 0.0, 0.0]]))  # 4 is out: weight 0
    assert metrics["rollout_is_oob_ratio"] == pytest.approx(0.5)


def test_sequence_weight_is_the_product_over_the_response():
    log_ratio, mask = t([[LN2, math.log(1.5), 5.0], [0.0, -LN2, 0.0]]), t([[1, 1, 0], [1, 1, 0]])
    weights, metrics = rc.is_weights(log_ratio, mask, "sequence", 2.5)
    # row 0: 2 * 1.5 = 3, clamped at 2.5 (the masked 5.0 does not count); row 1: 0.5
    assert torch.allclose(weights, t([[2.5, 2.5, 0.0], [0.5, 0.5, 0.0]]))
    assert metrics["rollout_is_max"] == pytest.approx(3.0)  # before truncation
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)


def test_batch_normalize_divides_by_the_mean_weight():
    weights, metrics = rc.is_weights(t([[0.0, LN3]]), t([[1, 1]]), "token", 5.0, True)
    assert torch.allclose(weights, t([[0.5, 1.5]]))  # mean of 1 and 3 is 2
    assert metrics["rollout_is_batch_norm_factor"] == pytest.approx(2.0)


def test_effective_sample_size():
    mask = t([[1, 1]])
    assert effective_sample_size(t([[1.0, 1.0]]), mask) == pytest.approx(1.0)
    assert effective_sample_size(t([[1.0, 3.0]]), mask) == pytest.approx(0.8)  # 1/((.25+2.25)/2)
    assert effective_sample_size(t([[0.0, 0.0]]), mask) == 0.0


def test_divergences_k1_k2_k3():
    k = rc.divergences(t([[LN2]]))
    assert k["k1"].item() == pytest.approx(-LN2)
    assert k["k2"].item() == pytest.approx(0.5 * LN2**2)
    assert k["k3"].item() == pytest.approx(2.0 - 1.0 - LN2)


def test_sequence_stat_sum_mean_max():
    x, mask = t([[1.0, 3.0, 9.0], [0.0, 0.0, 0.0]]), t([[1, 1, 0], [0, 0, 0]])
    assert rc.sequence_stat(x, mask, "sum").tolist() == [4.0, 0.0]
    assert rc.sequence_stat(x, mask, "mean").tolist() == pytest.approx([2.0, 0.0])
    assert rc.sequence_stat(x, mask, "max").tolist() == [3.0, 0.0]  # empty row: 0


def test_token_k1_rejection_bounds_the_rollout_over_train_ratio():
    # ratios pi_rollout / pi_train: 1/4, 1/1.5, 3; kept within [0.5, 2]: only the middle one
    log_ratio, mask = t([[math.log(4.0), math.log(1.5), -LN3]]), t([[1, 1, 1]])
    kept, metrics = rc.rejection_mask(log_ratio, mask, "token_k1", "0.5_2")
    assert kept.tolist() == [[0.0, 1.0, 0.0]]
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(2 / 3)
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert metrics["rollout_rs_token_k1_fraction_low"] == pytest.approx(1 / 3)


def test_seq_mean_k3_rejects_whole_sequences():
    # row 0: log r = 0 everywhere (k3 = 0); row 1: log r = ln 2 (k3 = 1 - ln 2 ~ 0.307)
    log_ratio, mask = t([[0.0, 0.0], [LN2, LN2]]), t([[1, 1], [1, 0]])
    kept, metrics = rc.rejection_mask(log_ratio, mask, "seq_mean_k3", 0.1)
    assert kept.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert metrics["rollout_rs_seq_mean_k3_seq_max"] == pytest.approx(1.0 - LN2)
    assert metrics["rollout_rs_seq_mean_k3_seq_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(1 / 3)  # 1 of 3 tokens


def test_mismatch_metrics_by_hand():
    old, rollout, mask = t([[math.log(0.5), math.log(0.25)]]), t([[math.log(0.5)] * 2]), t([[1, 1]])
    m = mismatch_metrics(old, rollout, mask)
    assert m["training_log_ppl"] == pytest.approx(1.5 * LN2)
    assert m["training_ppl"] == pytest.approx(2**1.5)
    assert m["rollout_ppl"] == pytest.approx(2.0)
    assert m["kl"] == pytest.approx(LN2 / 2)
    assert m["k3_kl"] == pytest.approx((0.5 - 1 + LN2) / 2)
    assert m["log_ppl_diff"] == pytest.approx(0.5 * LN2)
    assert m["ppl_ratio"] == pytest.approx(math.sqrt(2))
    assert m["chi2_token"] == pytest.approx((1 + 0.25) / 2 - 1)
    assert m["chi2_seq"] == pytest.approx(0.25 - 1)  # (1 * 0.5)^2 - 1


def test_mismatch_metrics_count_only_masked_tokens():
    old, rollout = t([[0.0, -9.0]]), t([[0.0, -1.0]])
    m = mismatch_metrics(old, rollout, t([[1, 0]]))
    assert m["kl"] == 0.0 and m["chi2_token"] == 0.0 and m["training_ppl"] == 1.0


def test_correct_puts_it_together_under_rollout_corr():
    old, rollout, mask = t([[LN2, 0.0]]), t([[0.0, 0.0]]), t([[1, 1]])
    params = rc.CorrectionParams(
        rollout_is="token", rollout_rs="token_k3", rollout_rs_threshold=0.1
    )
    fix = rc.correct(old, rollout, mask, params)
    assert torch.allclose(fix.weights, t([[2.0, 1.0]]))
    assert fix.mask.tolist() == [[0.0, 1.0]]  # k3 of ln 2 = 0.307 > 0.1
    assert fix.metrics["rollout_corr/kl"] == pytest.approx(-LN2 / 2)
    assert all(name.startswith("rollout_corr/") for name in fix.metrics)
    with pytest.raises(ValueError):
        rc.correct(old, rollout[:, :1], mask, params)


def test_reinforce_loss_weights_each_token():
    logprob, adv = t([[-1.0, -2.0]]), t([[1.0, 2.0]])
    loss, ppo_kl = rc.reinforce_loss(
        logprob, t([[-1.0, -1.0]]), adv, t([[1, 1]]), "token-mean", t([[2.0, 1.0]])
    )
    assert loss.item() == pytest.approx((2.0 + 4.0) / 2)  # -(1*-1*2 + 2*-2*1) / 2
    assert ppo_kl.item() == pytest.approx(0.5)  # mean(rollout - logprob) = (0 + 1) / 2


def inputs(logprob, rollout, adv, mask) -> LossInputs:
    return LossInputs(
        logits=torch.zeros(*mask.shape, 3),
        logprob=logprob,
        old_logprob=logprob,
        advantages=adv,
        response_mask=mask,
        rollout_logprob=rollout,
    )


def test_bypass_ppo_clip_is_ppo_against_the_rollout_policy_on_kept_tokens():
    logprob = t([[-1.0, -0.5, -2.0]]).requires_grad_(True)
    rollout, adv, mask = t([[-1.1, -2.0, -2.0]]), t([[1.0, -1.0, 0.5]]), t([[1, 1, 1]])
    corr = rc.CorrectionParams(bypass_mode=True, rollout_rs="token_k1", rollout_rs_threshold=2.0)
    out, metrics = bypass_policy_loss(
        LossParams(correction=corr), inputs(logprob, rollout, adv, mask)
    )
    kept = t([[1, 0, 1]])  # token 1: pi / pi_rollout = e^1.5 > 2 is rejected
    expected = policy_loss_ppo_clip(rollout, logprob, adv, kept)
    assert out.pg_loss.item() == pytest.approx(expected.pg_loss.item())
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)


def test_default_loss_measures_the_mismatch_and_changes_nothing():
    logprob, rollout = t([[-1.0, -0.5]]), t([[-1.0, -1.0]])
    adv, mask = t([[1.0, 1.0]]), t([[1, 1]])
    with_engine, metrics = actor_loss(LossParams(), inputs(logprob, rollout, adv, mask))
    plain, plain_metrics = actor_loss(LossParams(), inputs(logprob, None, adv, mask))
    assert with_engine.item() == plain.item()
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.25)
    assert not any(name.startswith("rollout_corr/") for name in plain_metrics)


def test_config_presets_fill_what_the_config_does_not_set():
    cfg = RolloutCorrectionConfig(preset="bypass_pg_geo_rs", rollout_rs_threshold="0.9_1.1")
    assert (cfg.bypass_mode, cfg.loss_type, cfg.rollout_rs) == (True, "reinforce", "seq_mean_k1")
    assert cfg.rollout_rs_threshold == "0.9_1.1"
    assert RolloutCorrectionConfig(preset="decoupled_k3_rs").decoupled
    assert not RolloutCorrectionConfig().active
    with pytest.raises(ValueError):
        RolloutCorrectionConfig(rollout_rs="seq_mean_k3")  # no threshold
