"""The Tinker API's four datum losses (rlfleet.rl.datum_losses) on hand-computed cases."""

import math

import pytest
import torch

from rlfleet.rl.datum_losses import LOSSES, cispo, cross_entropy, importance_sampling, ppo


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_cross_entropy_is_the_weighted_negative_log_likelihood() -> None:
    # -[0 * log .5, 1 * log .25, 0.5 * log .5] = [0, log 4, 0.5 log 2]
    loss = cross_entropy(t([math.log(0.5), math.log(0.25), math.log(0.5)]), t([0.0, 1.0, 0.5]))
    assert loss.tolist() == pytest.approx([0.0, math.log(4), 0.5 * math.log(2)])


def test_importance_sampling_weights_the_advantage_by_the_ratio() -> None:
    # p/q = 0.5/0.25 = 2 and 0.25/0.5 = 0.5; loss = -[2 * 1, 0.5 * -2] = [-2, 1]
    lp, q = t([math.log(0.5), math.log(0.25)]), t([math.log(0.25), math.log(0.5)])
    loss = importance_sampling(lp, q, t([1.0, -2.0]))
    assert loss.tolist() == pytest.approx([-2.0, 1.0])


def test_ppo_takes_the_pessimistic_of_clipped_and_unclipped() -> None:
    # ratios 2, 0.5, 2 with A = 1, 1, -1 and clip [0.8, 1.2]:
    # A>0, r=2: min(2, 1.2) = 1.2; A>0, r=.5: min(.5, .8) = .5; A<0, r=2: min(-2, -1.2) = -2
    lp = t([math.log(0.5), math.log(0.25), math.log(0.5)])
    q = t([math.log(0.25), math.log(0.5), math.log(0.25)])
    loss = ppo(lp, q, t([1.0, 1.0, -1.0]))
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 2.0])


def test_cispo_clips_a_detached_ratio_that_weights_the_log_likelihood() -> None:
    # r = 8 capped at 4, r = 0.5 kept (no lower bound): loss = -[4 log .5, .5 log .25] * A
    lp = torch.tensor([math.log(0.5), math.log(0.25)], requires_grad=True)
    q = t([math.log(0.5 / 8), math.log(0.5)])
    loss = cispo(lp, q, t([1.0, 2.0]))
    assert loss.tolist() == pytest.approx([-4 * math.log(0.5), -0.5 * math.log(0.25) * 2])
    loss.sum().backward()  # d/dlp = -clip(r) * A: the ratio carries no gradient
    assert lp.grad.tolist() == pytest.approx([-4.0, -1.0])


def test_registry_applies_config_and_optional_weights() -> None:
    lp, q, adv = t([math.log(0.5)]), t([math.log(0.25)]), t([1.0])
    spec = LOSSES["ppo"]
    config = {**spec.config, "clip_high_threshold": 1.5}
    assert spec.fn(lp, {"logprobs": q, "advantages": adv}, config).tolist() == pytest.approx([-1.5])
    halved = {"logprobs": q, "advantages": adv, "weights": t([0.5])}
    assert spec.fn(lp, halved, spec.config).tolist() == pytest.approx([-0.6])
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo"}
    assert LOSSES["cross_entropy"].inputs == ("weights",)
