"""verl's algorithm set on hand-computed cases: REINFORCE++-baseline, ReMax, dual-clip PPO,
GSPO, seq-mean-token-sum-norm, KL in the reward (fixed/adaptive), DAPO overlong shaping and
dynamic-sampling filter. Every expected number is worked out in the comments."""

import math

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.rl import advantages as adv_mod
from rlfleet.rl import core_algos as ca
from rlfleet.rl import shaping
from rlfleet.rl.losses import LossInputs, LossParams, actor_loss
from rlfleet.trainer.rewards_shaping import (
    ShapingInputs,
    kl_controller_for,
    shape_rewards,
    shaping_inputs,
)
from rlfleet.trainer.rollout_batch import RolloutBatch


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=0)


# --- estimators -----------------------------------------------------------------------------


def test_reinforce_pp_baseline_centres_per_group_then_whitens() -> None:
    # scores 1,0 | 1,1 -> centred 0.5,-0.5 | 0,0; batch mean 0, unbiased var 0.5/3 = 1/6,
    # std 0.4082483 -> 0.5 / 0.4082483 = 1.2247449
    rewards, mask = t([[1.0], [0.0], [1.0], [1.0]]), t([[1], [1], [1], [1]])
    adv, ret = adv_mod.reinforce_plus_plus_baseline_advantage(rewards, mask, ["a", "a", "b", "b"])
    close(adv, [[1.2247449], [-1.2247449], [0.0], [0.0]])
    close(ret, adv.tolist())


def test_reinforce_pp_baseline_whitens_over_tokens_and_keeps_singletons_raw() -> None:
    # two groups of one keep raw scores 3 and 1, broadcast over the mask: 3,3 | 1,(pad).
    # mean 7/3; deviations 2/3, 2/3, -4/3; var = (4/9+4/9+16/9)/2 = 4/3, std 1.1547005
    rewards, mask = t([[0.0, 3.0], [1.0, 0.0]]), t([[1, 1], [1, 0]])
    params = adv_mod.AdvantageParams(estimator="reinforce_plus_plus_baseline")
    inputs = adv_mod.AdvantageInputs(rewards, mask, group_index=[0, 1])
    adv, _ = adv_mod.compute_advantage(params, inputs)
    close(adv, [[0.5773503, 0.5773503], [-1.1547005, 0.0]])


def test_remax_subtracts_greedy_baseline_from_reward_to_go() -> None:
    # returns: row 0 reward 1 on its last token -> 1, 1; row 1 scored 0 (one token, padded).
    rewards, mask = t([[0.0, 1.0], [0.0, 0.0]]), t([[1, 1], [1, 0]])
    params = adv_mod.AdvantageParams(estimator="remax")
    inputs = adv_mod.AdvantageInputs(rewards, mask, baseline_scores=t([0.5, 0.5]))
    adv, ret = adv_mod.compute_advantage(params, inputs)
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    close(adv, [[0.5, 0.5], [-0.5, 0.0]])


def test_remax_without_baseline_scores_says_what_is_missing() -> None:
    inputs = adv_mod.AdvantageInputs(t([[1.0]]), t([[1]]))
    with pytest.raises(ValueError, match="remax.*baseline_scores.*greedy"):
        adv_mod.compute_advantage(adv_mod.AdvantageParams(estimator="remax"), inputs)


# --- policy losses ----------------------------------------------------------------------------


def _ppo(ratios, advs, **kw):
    logp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    out = ca.policy_loss_ppo_clip(
        torch.zeros(1, len(ratios)), logp, t([advs]), torch.ones(1, len(ratios)), **kw
    )
    out.pg_loss.backward()
    return out, logp.grad[0].tolist()


def test_dual_clip_caps_negative_advantage_loss_at_c() -> None:
    # ratio 4, A=-1: max(4, 1.2) = 4 -> capped at 3 (no gradient); ratio 2, A=-1: 2 (< 3);
    # ratio 4, A=+1: max(-4, -1.2) = -1.2, never floored. token-mean = (3 + 2 - 1.2) / 3
    out, grad = _ppo([4.0, 2.0, 4.0], [-1.0, -1.0, 1.0], clip_ratio_c=3.0)
    close(out.pg_loss, 1.2666667)
    close(out.pg_clipfrac_lower, 1 / 3)
    assert grad == pytest.approx([0.0, 2.0 / 3, 0.0])  # d(r)/dlogp = r, over 3 tokens


def test_without_dual_clip_the_loss_grows_with_the_ratio() -> None:
    out, grad = _ppo([4.0], [-1.0], clip_ratio_c=None)
    close(out.pg_loss, 4.0)
    assert grad == pytest.approx([4.0])


def test_gspo_uses_the_sequence_geometric_mean_ratio() -> None:
    # seq 0: log-ratios ln1.5, ln0.5 -> s = sqrt(0.75) = 0.8660254 (inside [0.8, 1.2]),
    # loss -0.8660254 on both tokens; seq 1 (one token, ln 2): s = 2 -> clipped to 1.2, -1.2.
    # seq-mean-token-mean: (-0.8660254 - 1.2) / 2 = -1.0330127
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(2.0), 0.0]], requires_grad=True)
    mask = t([[1, 1], [1, 0]])
    out = ca.policy_loss_gspo(torch.zeros(2, 2), logp, t([[1.0, 1.0], [1.0, 1.0]]), mask)
    close(out.pg_loss, -1.0330127)
    close(out.pg_clipfrac, 1 / 3)
    out.pg_loss.backward()
    # d/dlogp_t of -s (every token carries s): -s * 1/2 (token mean) * 1/2 (seq mean)
    close(logp.grad, [[-0.2165064, -0.2165064], [0.0, 0.0]])


def test_actor_loss_dispatches_gspo_and_rejects_unknown_modes() -> None:
    x = LossInputs(
        logits=torch.zeros(1, 2, 2),
        logprob=t([[math.log(1.5), math.log(0.5)]]),
        old_logprob=t([[0.0, 0.0]]),
        advantages=t([[1.0, 1.0]]),
        response_mask=t([[1, 1]]),
    )
    loss, metrics = actor_loss(LossParams(policy_loss_mode="gspo"), x)
    assert loss.item() == pytest.approx(-0.8660254)
    vanilla, _ = actor_loss(LossParams(), x)
    assert vanilla.item() == pytest.approx((-1.2 - 0.5) / 2)  # token ratios clip separately
    with pytest.raises(ValueError, match="policy_loss_mode"):
        actor_loss(LossParams(policy_loss_mode="cispo"), x)  # type: ignore[arg-type]


def test_seq_mean_token_sum_norm_divides_by_a_constant_horizon() -> None:
    loss, mask = t([[1, 2, 3], [4, 50, 50], [9, 9, 9]]), t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum-norm"), 10 / 3)  # sum 10 / width 3
    close(ca.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=5), 2.0)


def test_actor_loss_with_sum_norm_uses_loss_scale_factor() -> None:
    # on-policy, A = 1 on two tokens: pg = -(1 + 1) / 4
    x = LossInputs(torch.zeros(1, 2, 2), t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([[1, 1]]), t([[1, 1]]))
    params = LossParams(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=4)
    loss, metrics = actor_loss(params, x)
    assert loss.item() == pytest.approx(-0.5)
    assert metrics["actor/entropy"] == pytest.approx(2 * math.log(2) / 4)


def test_kl_penalty_accepts_verl_names() -> None:
    logp, ref = t([[0.0, math.log(0.5)]]), t([[math.log(0.5), 0.0]])
    close(ca.kl_penalty(logp, ref, "kl"), ca.kl_penalty(logp, ref, "k1").tolist())
    close(ca.kl_penalty(logp, ref, "mse"), ca.kl_penalty(logp, ref, "k2").tolist())
    close(ca.kl_penalty(logp, ref, "abs"), [[math.log(2), math.log(2)]])


# --- KL in the reward ------------------------------------------------------------------------


def test_apply_kl_penalty_hand_computed() -> None:
    # k1 per token: ln2, 0 | ln2, (pad). coef 0.1 -> rewards -0.0693147, 1 | -0.0693147, 0.
    # kl_mean: row means ln2/2 = 0.3465736 and ln2 = 0.6931472 -> 0.5198604
    rewards, mask = t([[0.0, 1.0], [0.0, 0.0]]), t([[1, 1], [1, 0]])
    logp = t([[math.log(0.5), math.log(0.5)], [0.0, 0.0]])
    ref = t([[math.log(0.25), math.log(0.5)], [math.log(0.5), 9.0]])
    shaped, kl_mean = shaping.apply_kl_penalty(rewards, logp, ref, mask, 0.1, "kl")
    close(shaped, [[-0.0693147, 1.0], [-0.0693147, 0.0]])
    assert kl_mean == pytest.approx(0.5198604)


def test_adaptive_kl_controller_follows_ziegler_update() -> None:
    ctrl = shaping.AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.15, n_steps=10)  # error 0.5 clipped to 0.2: x (1 + 0.2*10/100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.09, n_steps=10)  # error -0.1: x (1 - 0.01)
    assert ctrl.value == pytest.approx(0.10098)
    fixed = shaping.make_kl_controller("fixed", 0.3)
    fixed.update(5.0, 10)
    assert fixed.value == 0.3
    with pytest.raises(ValueError, match="fixed, adaptive"):
        shaping.make_kl_controller("pid", 0.1)


# --- DAPO -----------------------------------------------------------------------------------


def test_overlong_penalty_ramps_over_the_buffer() -> None:
    # max 10, buffer 4: free up to 6 tokens, then -(len - 6) / 4 * factor
    close(shaping.overlong_penalty(torch.tensor([5, 6, 8, 10]), 10, 4), [0, 0, -0.5, -1.0])
    close(shaping.overlong_penalty(torch.tensor([8, 10]), 10, 4, 0.5), [-0.25, -0.5])


def test_groups_with_signal_drops_uniform_groups_and_keeps_singletons() -> None:
    scores = t([1, 1, 0, 1, 0.5, 0.5, 2])
    keep = shaping.groups_with_signal(scores, ["a", "a", "b", "b", "c", "c", "d"])
    assert keep.tolist() == [False, False, True, True, False, False, True]
    assert shaping.groups_with_signal(t([]), []).tolist() == []


# --- trainer-side shaping and config ---------------------------------------------------------


def test_shape_rewards_adds_overlong_then_subtracts_kl() -> None:
    config = load_config(
        overrides=[
            "rollout.max_tokens=4",
            "algorithm.overlong_buffer.enable=true",
            "algorithm.overlong_buffer.len=2",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.kl_coef=0.5",
        ]
    )
    batch = RolloutBatch(responses=[[1, 2, 3, 4], [1, 2]])
    batch.engine_logprobs = [[0.0] * 4, [0.0] * 2]
    batch.ref_logprobs = [[0.0, 0.0, 0.0, -1.0], [0.0, 0.0]]
    rewards, mask = t([[0, 0, 0, 1.0], [0, 1.0, 0, 0]]), t([[1, 1, 1, 1], [1, 1, 0, 0]])
    ctrl = kl_controller_for(config)
    shaped, metrics = shape_rewards(shaping_inputs(batch, rewards, mask), config, ctrl)
    # row 0: 4 tokens = limit -> penalty -1 on the last token (1 - 1 = 0), then k1 = 1 there: -0.5
    close(shaped, [[0, 0, 0, -0.5], [0, 1.0, 0, 0]])
    assert metrics["reward/overlong_penalty/mean"] == pytest.approx(-0.5)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.125)  # (1/4 + 0) / 2
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    assert metrics["critic/rewards/mean"] == pytest.approx(0.25)


def test_shape_rewards_is_identity_when_off_and_names_missing_logprobs() -> None:
    config = load_config()
    x = ShapingInputs(t([[1.0]]), t([[1.0]]))
    assert shape_rewards(x, config, None) == (x.token_level_rewards, {})
    kl_on = load_config(overrides=["algorithm.use_kl_in_reward=true"])
    with pytest.raises(ValueError, match="log-probs"):
        shape_rewards(x, kl_on, kl_controller_for(kl_on))


def test_config_kl_in_reward_needs_reference_and_bad_knobs_fail() -> None:
    cfg = load_config(overrides=["trainer.use_kl_loss=false", "algorithm.use_kl_in_reward=true"])
    assert cfg.needs_reference and cfg.needs_refcritic
    assert not load_config(overrides=["trainer.use_kl_loss=false"]).needs_reference
    bad = [
        "trainer.clip_ratio_c=1.0",
        "algorithm.kl_ctrl.type=adaptive",  # with target_kl below
        "algorithm.overlong_buffer.enable=true",  # len 0
        "trainer.policy_loss_mode=cispo",
        "trainer.logger=[console, neptune]",
    ]
    extra = {"algorithm.kl_ctrl.type=adaptive": ["algorithm.kl_ctrl.target_kl=0"]}
    for item in bad:
        with pytest.raises(ValueError):
            load_config(overrides=[item, *extra.get(item, [])])
