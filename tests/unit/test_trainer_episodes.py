"""Agent mode in the trainer: episodes become rows whose loss mask keeps environment tokens
out of the loss, the advantages and the length metrics (hand-computed cases, then one step
through a real ``Trainer`` with an in-process episode source)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from trainer_fakes import GOOD_TOKEN, make_trainer, prompts

from rlfleet.agent.episode import Episode
from rlfleet.common.config import load_config
from rlfleet.common.trajectory import Trajectory
from rlfleet.env.types import EpisodeJob, EpisodeResult
from rlfleet.rl.advantages import (
    AdvantageInputs,
    AdvantageParams,
    EstimatorName,
    compute_advantage,
)
from rlfleet.rollout.types import SamplingParams
from rlfleet.trainer.episodes import EpisodeSource, episode_jobs, episode_metrics
from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask, token_level_rewards
from rlfleet.trainer.staleness import staleness_metrics

SAMPLED, ENV = 1, 0
PATTERN = [SAMPLED, SAMPLED, ENV, ENV, SAMPLED, SAMPLED]  # turn, observation, turn


def test_response_mask_keeps_only_sampled_tokens():
    mask = response_mask([4, 2], [[1, 0, 0, 1], [1, 1]])
    assert mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    assert response_mask([3, 1]).tolist() == [[1, 1, 1], [1, 0, 0]]


def test_outcome_reward_sits_on_the_last_sampled_token():
    rewards = token_level_rewards([1.0, 2.0], [4, 3], [[1, 1, 0, 0], [0, 1, 1]])
    assert rewards.tolist() == [[0, 1.0, 0, 0], [0, 0, 2.0, 0]]


def result(episode: Episode, restarts: int = 0) -> EpisodeResult:
    """What the env service answers for a played episode."""
    return EpisodeResult(episode.episode_id, episode, "", restarts, ["r0"])


def scripted_episode(job: dict, version: int, rng: random.Random) -> Episode:
    """Two sampled turns around two environment tokens; reward counts GOOD_TOKEN sampled."""
    episode = Episode(episode_id=job["episode_id"], prompt_ids=[1, 2, 3])
    for flag in PATTERN:
        token = rng.choice([GOOD_TOKEN, 7, 8])
        if flag:
            episode.extend_sampled([token], [-1.0], [version])
        else:
            episode.extend_environment([9])
    episode.reward = episode.sampled_ids().count(GOOD_TOKEN) / 4
    episode.num_turns, episode.tool_calls = 2, 1
    return episode


class ScriptedEpisodes(EpisodeSource):
    """An env service stand-in: answers every job with a scripted episode."""

    def __init__(self, version_offset: int = 0) -> None:
        self.calls: list[tuple[list[dict], object]] = []
        self.version_offset = version_offset
        self.rng = random.Random(0)

    async def run_episodes(
        self,
        jobs: Sequence[EpisodeJob | dict[str, Any]],
        sampling: SamplingParams | None = None,
        max_turns: int = 0,
        max_episode_tokens: int = 0,
    ) -> list[EpisodeResult]:
        rows = [job for job in jobs if isinstance(job, dict)]  # the trainer sends rows
        self.calls.append((rows, sampling))
        offset, rng = self.version_offset, self.rng
        return [result(scripted_episode(j, j["min_weight_version"] + offset, rng)) for j in rows]

    async def wait_ready(self, timeout_s: float) -> None:
        pass

    async def close(self) -> None:
        pass


def agent_trainer(**overrides):
    trainer = make_trainer(**{"agent.env": "calc", "agent.max_episode_tokens": 64, **overrides})
    trainer.fleet.env = ScriptedEpisodes()
    seen = {}
    update = trainer.actor.update

    def recording_update(batch, advantages, mask):
        seen.update(advantages=advantages.clone(), mask=mask.clone(), batch=batch)
        return update(batch, advantages, mask)

    trainer.actor.update = recording_update
    return trainer, seen


def test_an_agent_step_trains_sampled_tokens_only_and_reports_agent_metrics():
    trainer, seen = agent_trainer()
    asyncio.run(trainer.start(1, 1.0))
    metrics = asyncio.run(trainer.train_step(prompts(4)))
    jobs, sampling = trainer.fleet.env.calls[0]
    assert len(jobs) == 4 * 8 and sampling.n == 1  # rollout.n episodes per prompt
    assert len({j["group_id"] for j in jobs}) == 4
    assert trainer.fleet.rollout.requests == []  # generation went through the env service
    mask = seen["mask"]
    assert mask.shape == (32, len(PATTERN))
    assert (mask == torch.tensor(PATTERN, dtype=mask.dtype)).all()
    assert (seen["advantages"][:, 2:4] == 0).all()  # no advantage on environment tokens
    assert metrics["response_length/mean"] == sum(PATTERN)  # sampled tokens only
    assert metrics["agent/turns/mean"] == 2 and metrics["agent/tool_calls/mean"] == 1
    assert metrics["critic/score/mean"] == pytest.approx(
        sum(seen["batch"].scores) / len(seen["batch"].scores)
    )


def test_episode_jobs_are_deterministic_groups_of_n():
    records = prompts(2)
    jobs = episode_jobs(records, "run-s3", 3, min_version=5)
    assert [j["episode_id"] for j in jobs[:3]] == ["run-s3-p0-e0", "run-s3-p0-e1", "run-s3-p0-e2"]
    assert {j["group_id"] for j in jobs} == {"run-s3-g0", "run-s3-g1"}
    assert all(j["min_weight_version"] == 5 for j in jobs)
    assert jobs == episode_jobs(records, "run-s3", 3, min_version=5)  # a retry asks the same


def test_episode_metrics_count_ends_and_parts():
    done = Episode(
        episode_id="a", prompt_ids=[1], num_turns=3, tool_calls=2, reward_parts={"format": 1.0}
    )
    cut = Episode(episode_id="b", prompt_ids=[1], num_turns=1, tool_errors=1)
    cut.end_reason = "token_budget"
    metrics = episode_metrics([result(done), result(cut, restarts=1)])
    assert metrics["agent/turns/mean"] == 2.0
    assert metrics["agent/tool_errors"] == 1.0
    assert metrics["agent/truncated"] == 0.5
    assert metrics["agent/restarts"] == 1.0
    assert metrics["agent/reward/format/mean"] == 0.5


def test_token_staleness_is_per_sampled_token():
    batch = RolloutBatch(weight_versions=[3, 5], token_versions=[[3, -1, 5], [5, 5]])
    metrics = staleness_metrics(batch, version=5, dropped=0)
    assert metrics["async/staleness/max"] == 2.0
    assert metrics["async/staleness/token_mean"] == pytest.approx(2 / 4)
    assert metrics["async/staleness/token_max"] == 2.0


def test_agent_mode_refuses_what_it_cannot_train_yet():
    with pytest.raises(Exception, match="gae"):
        load_config(None, ["agent.env=calc", "algorithm.adv_estimator=gae"], env={})


def branched_episode(episode_id: str, reward: float, branches: int) -> Episode:
    """An episode of ``branches`` records (a gateway session whose calls did not extend one
    another), each one sampled turn after its own prompt."""
    records = [Trajectory.of_call([1, 2, b], [5, 6], [-1.0, -1.0], [0, 0]) for b in range(branches)]
    *earlier, last = records
    return Episode(
        episode_id=episode_id, **vars(last), earlier=earlier, reward=reward, num_turns=branches
    )


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_every_branch_gets_its_episodes_advantage(estimator: EstimatorName) -> None:
    rewards, branches = [1.0, 0.0, 1.0, 0.0], [3, 1, 1, 2]
    split, whole = RolloutBatch(), RolloutBatch()
    results = [
        result(branched_episode(f"e{i}", r, k))
        for i, (r, k) in enumerate(zip(rewards, branches, strict=True))
    ]
    split.add_episode_group(prompts(1)[0], 0, results)
    whole.add_episode_group(
        prompts(1)[0], 0, [result(branched_episode(f"w{i}", r, 1)) for i, r in enumerate(rewards)]
    )
    assert len(split) == sum(branches) and split.episode_ids[:3] == ["e0"] * 3
    params = AdvantageParams(estimator=estimator)
    per_row = advantages_of(split, params)
    per_episode = advantages_of(whole, params)
    rows_of = [i for i, k in enumerate(branches) for _ in range(k)]
    if estimator == "reinforce_plus_plus_baseline":  # whitened over rows: same sign and order
        assert torch.equal(per_row.sign(), per_episode[rows_of].sign())
    else:
        assert torch.allclose(per_row, per_episode[rows_of])


def advantages_of(batch: RolloutBatch, params: AdvantageParams) -> torch.Tensor:
    """Each row's advantage (on its one sampled turn)."""
    lengths, masks = batch.response_lengths(), batch.row_loss_masks()
    inputs = AdvantageInputs(
        token_level_rewards(batch.scores, lengths, masks),
        response_mask(lengths, masks),
        batch.group_ids,
        episode_index=batch.row_episodes(),
    )
    return compute_advantage(params, inputs)[0][:, -1]


def test_a_branched_episode_counts_once_in_the_metrics_and_all_its_calls_as_turns() -> None:
    metrics = episode_metrics(
        [result(branched_episode("a", 1.0, 3)), result(branched_episode("b", 0.0, 1))]
    )
    assert metrics["agent/turns/mean"] == 2.0 and metrics["agent/branches/mean"] == 2.0
    assert metrics["agent/sampled_tokens/mean"] == 4.0  # two per branch, every branch counted
