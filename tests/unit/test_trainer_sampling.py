"""ReMax's greedy baselines and DAPO's dynamic sampling through the trainer (in-process fakes
of ``trainer_fakes``: the actor's own model samples, a counting reward scores)."""

from __future__ import annotations

import asyncio

import pytest
from trainer_fakes import make_trainer, prompts

from rlfleet.trainer.dynamic_sampling import fill_batch, with_signal
from rlfleet.trainer.metrics import Timer
from rlfleet.trainer.rollout_batch import RolloutBatch


def test_remax_asks_for_one_greedy_baseline_per_prompt_in_the_same_call():
    trainer = make_trainer(**{"algorithm.adv_estimator": "remax"})
    asyncio.run(trainer.start(1, 1.0))
    metrics = asyncio.run(trainer.train_step(prompts(3)))
    requests = trainer.fleet.rollout.requests
    greedy = [r for r in requests if r.sampling.temperature == 0.0]
    assert len(requests) == 6 and len(greedy) == 3
    assert all(r.sampling.n == 1 for r in greedy)
    assert "critic/advantages/mean" in metrics


def batch_of(scores: list[float], group_size: int) -> RolloutBatch:
    batch = RolloutBatch()
    for i, score in enumerate(scores):
        batch.records.append(None)
        batch.prompts.append([1])
        batch.responses.append([i])
        batch.group_ids.append(i // group_size)
        batch.scores.append(score)
    return batch


def test_groups_without_spread_are_dropped():
    kept, dropped = with_signal(batch_of([1, 1, 0, 1, 0, 0], group_size=2))
    assert dropped == 2
    assert kept.group_ids == [1, 1] and kept.scores == [0, 1]


def test_fill_batch_generates_until_enough_groups_teach():
    rounds: list[int] = []

    async def one_round(more, index):
        rounds.append(index)
        return batch_of([0, 1, 1, 1], group_size=2)  # one group with a spread per round

    first = batch_of([1, 1, 0, 0], group_size=2)  # nothing to learn from
    batch, metrics = asyncio.run(fill_batch(first, 2, 10, lambda: ["p"], one_round))
    assert rounds == [1, 2]
    assert len(set(batch.group_ids)) == 2 and len(batch) == 4
    assert metrics == {
        "dapo/gen_rounds": 3.0,
        "dapo/dropped_groups": 4.0,
        "dapo/kept_groups": 2.0,
        "batch/dropped_groups": 4.0,
        "batch/refill_rounds": 2.0,
    }


def test_fill_batch_stops_after_max_rounds():
    async def one_round(more, index):
        return batch_of([1, 1], group_size=2)

    batch, metrics = asyncio.run(fill_batch(batch_of([0, 0], 2), 4, 3, lambda: [], one_round))
    assert len(batch) == 0 and metrics["dapo/gen_rounds"] == 3.0


def test_dynamic_sampling_in_a_step_draws_more_prompts():
    trainer = make_trainer(**{"algorithm.filter_groups.enable": "true", "data.train_batch_size": 4})
    asyncio.run(trainer.start(1, 1.0))
    drawn: list[int] = []

    def refill():
        drawn.append(1)
        return prompts(4)

    batch = asyncio.run(trainer.collector.produce(prompts(4), 0, trainer.version, Timer(), refill))
    metrics = batch.sampling_metrics
    assert metrics["dapo/gen_rounds"] == pytest.approx(1 + len(drawn))
    assert len(set(batch.group_ids)) <= 4
