"""verl's ``training/rollout_probs_diff_*``: the engine's probability of each sampled token
against the actor's recomputed one, on a hand-computed example, and the trainer reporting it
only for rows sampled with the weights it holds."""

from __future__ import annotations

import asyncio
import math

import pytest
from test_trainer_step import make_trainer, prompts

from rlfleet.trainer.metrics import rollout_probs_diff


def test_the_difference_is_of_probabilities_over_response_tokens():
    engine = [[math.log(0.5), math.log(0.25)], [math.log(0.9)]]
    actor = [[math.log(0.4), math.log(0.25)], [math.log(0.6)]]
    diffs = [0.1, 0.0, 0.3]
    mean = sum(diffs) / 3
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3)
    got = rollout_probs_diff(engine, actor)
    assert got["training/rollout_probs_diff_max"] == pytest.approx(0.3)
    assert got["training/rollout_probs_diff_mean"] == pytest.approx(mean)
    assert got["training/rollout_probs_diff_std"] == pytest.approx(std)


def test_masked_positions_do_not_count_and_no_rows_give_no_metric():
    engine = [[math.log(0.5), math.log(0.9)]]
    actor = [[math.log(0.5), math.log(0.1)]]
    got = rollout_probs_diff(engine, actor, masks=[[1, 0]])  # the 0.8 gap is a tool's token
    assert got["training/rollout_probs_diff_max"] == pytest.approx(0.0)
    assert rollout_probs_diff([], []) == {}


def test_the_trainer_reports_it_for_current_rows_only():
    trainer = make_trainer(
        **{"trainer.ppo_mini_batch_size": 8, "trainer.old_logprob_source": "actor"}
    )
    asyncio.run(trainer.start(1, 1.0))
    batch = asyncio.run(trainer.collector.generate(prompts(2), 0, 1))
    batch.engine_logprobs = [[math.log(0.5)] * len(r) for r in batch.responses]
    batch.weight_versions = [trainer.version] * len(batch)
    metrics = asyncio.run(trainer.old_logprobs(batch))
    expected = [abs(0.5 - math.exp(a)) for row in batch.old_logprobs for a in row]
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(max(expected))
    batch.weight_versions = [trainer.version - 1] * len(batch)  # stale rows differ by design
    assert asyncio.run(trainer.old_logprobs(batch)) == {}
