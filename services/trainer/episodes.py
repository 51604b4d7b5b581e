"""Multi-turn episodes as training rows: the trainer's side of agent mode (``agent.env`` set).

Why a row per branch, grouped by episode: GRPO/RLOO compare the episodes of one task, so an
episode is what a completion is in single-turn mode. An episode the loop played is one
record (one row); one whose agent drove the gateway may be several (``Episode.branches``: its
calls did not form one token-native sequence), each a row of its own. A row's
``response_ids`` hold the sampled turns and, between them, the tokens the environment and
the chat template added; its ``response_mask`` travels with it as its loss mask, so loss,
entropy, KL and the length metrics count sampled tokens only. The outcome reward (the
episode's, on every branch) sits on the last sampled token, the behaviour log-probs are the
engine's per sampled token (0 where the mask is 0), and the row's weight version is its
oldest sampled token's (its staleness in async mode).

Advantages with branches: every branch of an episode gets the episode's advantage. The
group statistics of GRPO, RLOO and REINFORCE++-baseline count episodes, not rows (a row
weighs 1 / its episode's branches: ``RolloutBatch.episode_ids`` and
``rlfleet.rl.advantages``), so an agent that split its episode into three calls neither
weighs three times in its task's mean and std nor changes its siblings' advantages; this is
AReaL's choice for the calls of one proxied session (each call is trained with the session's
reward) and miles's for the branches of one trajectory tree. The loss then sums the
branches' sampled tokens, each token once (under ``loss_agg_mode: seq-mean-token-mean`` each
branch is a sequence of its own, as each call is a row in AReaL).

Episodes run in the env role (``rlfleet env``), never on the trainer's loop or cores: the
trainer sends one ``RunEpisodes`` per step through ``EpisodeSource`` and gets the episodes
back, already rewarded by their environments.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from rlfleet.env.types import Episode, EpisodeJob, EpisodeResult
from rlfleet.rollout.types import SamplingParams
from rlfleet.trainer.data import PromptRecord


class EpisodeSource(Protocol):
    """The env service as the trainer sees it (``rlfleet.env.client.EnvClient``)."""

    async def run_episodes(
        self,
        jobs: Sequence[EpisodeJob | dict[str, Any]],
        sampling: SamplingParams | None = None,
        max_turns: int = 0,
        max_episode_tokens: int = 0,
    ) -> list[EpisodeResult]: ...

    async def wait_ready(self, timeout_s: float) -> None: ...

    async def close(self) -> None: ...


def task_of(record: PromptRecord) -> dict[str, Any]:
    """The dataset row an environment's ``reset`` gets, in verl's schema (``prompt``,
    ``data_source``, ``reward_model.ground_truth``, ``extra_info``), as users' environments
    (TRL's ``reset(**row)``, verifiers, skyrl-gym) read it."""
    return {
        "prompt": record.prompt,
        "data_source": record.data_source,
        "reward_model": {"ground_truth": record.ground_truth},
        "extra_info": record.extra_info,
    }


def episode_jobs(
    records: Sequence[PromptRecord], prefix: str, n: int, min_version: int
) -> list[dict[str, Any]]:
    """``n`` episode jobs per record (one GRPO group per record, the group id its index).

    Ids are deterministic in the step's prefix, so a retried step asks for the same episodes
    and the env service answers the ones it already played from its results."""
    return [
        {
            "episode_id": f"{prefix}-p{index}-e{sample}",
            "group_id": f"{prefix}-g{index}",
            "task": task_of(record),
            "min_weight_version": min_version,
        }
        for index, record in enumerate(records)
        for sample in range(n)
    ]


def episode_metrics(results: Sequence[EpisodeResult]) -> dict[str, float]:
    """``agent/*`` metrics of one step's episodes (the names are pinned in the issue)."""
    episodes = [r.episode for r in results]
    if not episodes:
        return {}
    count = len(episodes)
    ends = Counter(str(e.end_reason) for e in episodes)
    metrics = {
        "agent/episodes": float(count),
        "agent/turns/mean": sum(e.num_turns for e in episodes) / count,
        "agent/tool_calls/mean": sum(e.tool_calls for e in episodes) / count,
        "agent/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "agent/truncated": ends.get("token_budget", 0) / count,
        "agent/failed": ends.get("error", 0) / count,
        "agent/max_turns": ends.get("max_turns", 0) / count,
        "agent/restarts": float(sum(r.restarts for r in results)),
        "agent/episode_s/mean": sum(e.generate_s + e.env_s for e in episodes) / count,
        "agent/generate_s/mean": sum(e.generate_s for e in episodes) / count,
        "agent/env_s/mean": sum(e.env_s for e in episodes) / count,
        "agent/sampled_tokens/mean": sum(e.sampled_tokens for e in episodes) / count,
        "agent/branches/mean": sum(len(e.branches()) for e in episodes) / count,
    }
    metrics.update(_reward_parts(episodes))
    return metrics


def _reward_parts(episodes: Sequence[Episode]) -> dict[str, float]:
    """``agent/reward/<part>/mean`` for each named reward part any episode reported."""
    names = sorted({name for e in episodes for name in e.reward_parts})
    return {
        f"agent/reward/{name}/mean": sum(e.reward_parts.get(name, 0.0) for e in episodes)
        / len(episodes)
        for name in names
    }
