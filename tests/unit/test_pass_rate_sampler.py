"""Difficulty pools: prompts drawn by their chance of a GRPO group with a spread."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.common.errors import InvalidArgument
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.pass_rate_sampler import (
    PassRateSampler,
    PassRateSettings,
    spread_probability,
)


def records(per_source: dict[str, int]) -> list[PromptRecord]:
    return [
        PromptRecord(f"{source} {i}", source, i)
        for source, count in per_source.items()
        for i in range(count)
    ]


def sampler(data, batch_size=2, seed=0, **knobs) -> PassRateSampler:
    return PassRateSampler(data, batch_size, seed, PassRateSettings(group_size=4, **knobs))


def test_spread_probability_by_hand():
    # n=2, p=0.5: 1 - 0.25 - 0.25 = 0.5; p=0 or 1: no spread; n=4, p=0.5: 1 - 2/16 = 0.875
    got = spread_probability(np.array([0.5, 0.0, 1.0]), 2)
    assert got.tolist() == [0.5, 0.0, 0.0]
    assert spread_probability(np.array([0.5]), 4)[0] == pytest.approx(0.875)


def test_unseen_prompts_take_their_pools_smoothed_spread_share():
    data = records({"easy": 2, "hard": 2})
    s = sampler(data, prior_groups=2.0, floor=0.05)
    assert s.weights().tolist() == [1.0, 1.0, 1.0, 1.0]  # nothing seen: every pool promising
    s.observe([data[0]] * 4, [1, 1, 1, 1])  # easy 0: all right, no spread
    s.observe([data[2]] * 4, [0, 1, 0, 0])  # hard 0: a spread, pass rate 0.25
    w = s.weights()
    assert w[0] == pytest.approx(0.05)  # solved: the floor
    assert w[1] == pytest.approx((0 + 2) / (1 + 2))  # unseen easy: pool 0/1 spread, prior 2
    assert w[2] == pytest.approx(1 - 0.25**4 - 0.75**4)
    assert w[3] == pytest.approx((1 + 2) / (1 + 2))


def test_pass_rate_is_an_ema_of_group_means():
    data = records({"a": 2})
    s = sampler(data, ema=0.5)
    s.observe([data[0]] * 2, [1.0, 1.0])
    s.observe([data[0]] * 2, [0.0, 0.0])
    assert s.pass_rate[0] == pytest.approx(0.5)  # first group sets it; the second halves it
    s.observe(["not one of ours"], [1.0])  # validation rows and the like are ignored
    assert s.seen.tolist() == [True, False]


def test_draws_favour_prompts_with_signal_and_are_distinct_within_a_batch():
    data = records({"solved": 50, "mixed": 50})
    s = sampler(data, batch_size=10, floor=0.05)
    for record in data[:50]:
        s.observe([record] * 4, [1, 1, 1, 1])
    for record in data[50:]:
        s.observe([record] * 4, [1, 0, 1, 0])
    drawn = [next(s) for _ in range(50)]
    assert all(len({id(r) for r in batch}) == 10 for batch in drawn)
    mixed = sum(r.data_source == "mixed" for batch in drawn for r in batch)
    assert mixed / 500 > 0.85  # weights 0.875 vs 0.05: ~95% expected
    assert s.metrics()["data/pass_rate/seen_prompts"] == 100
    assert s.metrics()["data/pass_rate/spread_share/mixed"] == 1.0


def test_a_resumed_sampler_draws_what_the_first_would_have():
    data = records({"a": 6, "b": 6})
    first = sampler(data, batch_size=3, seed=7)
    next(first)
    first.observe([data[1]] * 4, [1, 0, 0, 0])
    saved = first.state()
    expected = [[r.ground_truth for r in next(first)] for _ in range(5)]
    second = sampler(data, batch_size=3, seed=999)
    second.load_state(saved)
    assert [[r.ground_truth for r in next(second)] for _ in range(5)] == expected


def test_state_of_other_data_is_refused():
    saved = sampler(records({"a": 3})).state()
    with pytest.raises(InvalidArgument, match="other training data"):
        sampler(records({"a": 4})).load_state(saved)


def test_a_batch_larger_than_the_data_is_refused():
    with pytest.raises(InvalidArgument, match="batch size 5"):
        sampler(records({"a": 3}), batch_size=5)
