"""``trainer.deterministic``'s pieces without servers: the per-request seed, results put back
in request order, the seeds the collector and the evaluator attach, the RNGs seeded, and the
combinations refused at config load. Two whole runs compared byte for byte are
``tests/integration/test_deterministic_runs.py``."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import torch
from trainer_fakes import CountingReward, SamplingRollout, make_trainer, prompts

from rlfleet.common.config import load_config
from rlfleet.common.errors import FailedPrecondition
from rlfleet.reward.types import ScoreRequest, ScoreResult
from rlfleet.rollout.types import GenerateRequest, GenerateResult
from rlfleet.trainer.determinism import DataOrder, in_request_order, request_seed, seed_process
from rlfleet.trainer.evaluate import Evaluator


def test_the_seed_is_a_pinned_hash_of_run_stream_step_and_position():
    # pinned: changing the derivation changes every deterministic run's samples
    assert request_seed(0, "train", 0, 0) == 8346756479699951624
    seeds = {
        request_seed(run, stream, step, pos)
        for run in (0, 1)
        for stream in ("train", "val")
        for step in (0, 1)
        for pos in (0, 1)
    }
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    # not a sum: run 1's step 0 is not run 0's step 1
    assert request_seed(1, "train", 0, 0) != request_seed(0, "train", 1, 0)


def test_results_go_back_in_request_order_and_a_gap_is_an_error():
    ids = ["a", "b", "c"]
    arrived = [("c", 3), ("a", 1), ("b", 2)]
    assert in_request_order(ids, arrived, lambda r: r[0]) == [("a", 1), ("b", 2), ("c", 3)]
    for broken in ([("a", 1), ("b", 2)], [("a", 1), ("a", 1), ("b", 2)], [*arrived, ("d", 4)]):
        with pytest.raises(FailedPrecondition, match="one to one"):
            in_request_order(ids, broken, lambda r: r[0])


class ArrivalOrderRollout(SamplingRollout):
    """Answers a batch last request first, as a fleet might when replicas finish out of order."""

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return [await self.generate(r) for r in reversed(requests)]


class ArrivalOrderReward(CountingReward):
    async def score_batch(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        return list(reversed(await super().score_batch(requests)))


def collect(**overrides):
    trainer = make_trainer(**overrides)
    rollout = ArrivalOrderRollout(trainer.actor.model)
    trainer.fleet.rollout = trainer.collector.fleet.rollout = rollout
    trainer.fleet.reward = trainer.collector.fleet.reward = ArrivalOrderReward()
    batch = asyncio.run(trainer.collector.generate(prompts(4), 3, 1))
    asyncio.run(trainer.collector.score(batch))
    return batch, rollout.requests


def test_a_step_is_built_in_request_order_with_a_seed_per_prompt():
    batch, requests = collect(**{"trainer.deterministic": "true", "trainer.seed": 7})
    n = 8
    assert batch.prompts == [p.token_ids for p in prompts(4) for _ in range(n)]
    assert batch.group_ids == [g for g in range(4) for _ in range(n)]
    good = chr(ord("a") + 5)
    assert batch.scores == [text.count(good) / 2 for text in batch.texts]
    seeds = {r.request_id.rsplit("-p", 1)[1]: r.sampling.seed for r in requests}
    assert seeds == {str(i): request_seed(7, "train", 3, i) for i in range(4)}


def test_without_deterministic_requests_carry_no_seed():
    _, requests = collect()
    assert [r.sampling.seed for r in requests] == [None] * 4


def test_validation_seeds_name_the_step_and_the_held_out_position():
    config = load_config(None, ["trainer.deterministic=true", "trainer.seed=3"], env={})
    evaluator = Evaluator(config, None, None, step=5)
    assert evaluator.seeds("val", 2) == [request_seed(3, "val", 5, i) for i in range(2)]
    assert Evaluator(load_config(None, [], env={}), None, None).seeds("val", 2) is None


def test_seeding_the_process_repeats_every_rng_and_turns_on_deterministic_kernels(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # put back afterwards
    try:
        draws = []
        for _ in range(2):
            seed_process(11, deterministic=True)
            draws.append((torch.rand(3).tolist(), np.random.rand(), random.random()))
        assert draws[0] == draws[1]
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_data_order_names_each_steps_prompts(tmp_path):
    batch, _ = collect()
    for i, record in enumerate(batch.records):
        record.index = 100 + batch.group_ids[i]
    order = DataOrder(tmp_path / "data_order.jsonl")
    order.write(1, batch.prompt_indices())
    rows = [json.loads(line) for line in order.path.read_text().splitlines()]
    assert rows == [{"step": 1, "prompts": [100, 101, 102, 103]}]


def config_with(*overrides: str):
    return load_config(None, ["trainer.deterministic=true", *overrides], env={})


def test_sync_mode_with_the_hf_engine_is_accepted_and_auto_means_hf():
    assert config_with("trainer.mode=sync", "rollout.backend=auto").rollout.backend == "hf"


@pytest.mark.parametrize(
    ("overrides", "error", "words"),
    [
        (["trainer.mode=async"], ValueError, "trainer.mode=sync"),
        (["rollout.backend=vllm"], ValueError, "rollout.backend=hf"),
        (["trainer.strategy=ddp", "trainer.world_size=2"], NotImplementedError, "ddp"),
    ],
)
def test_what_cannot_be_reproduced_is_refused_at_load(overrides, error, words):
    with pytest.raises(error, match=words):
        config_with(*overrides)
