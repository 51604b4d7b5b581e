"""Env workers without a router or a Redis: environments that fail are counted failed episodes
(never a dead worker), and the environment is resolved from ``agent.env``. The same workers on
the env stream of a real Redis: tests/integration/test_env_workers.py.
"""

# ruff: noqa: F811 - `renderer` and `nowhere` are fixtures imported from env_doubles
from __future__ import annotations

import time

import pytest
from env_doubles import (  # noqa: F401 - renderer and nowhere are fixtures
    NO_MODEL,
    SETTINGS,
    TASK,
    RaisingEnv,
    SlowEnv,
    agent,
    nowhere,
    renderer,
)

from rlfleet.agent.environment import ToolEnv
from rlfleet.agent.episode import EndReason, Episode
from rlfleet.common.config.agent import AgentConfig
from rlfleet.env.runner import EpisodeRunner, env_maker
from rlfleet.env.types import EpisodeJob, QueuedEpisode

pytestmark = NO_MODEL


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


class ToolUser(ToolEnv):
    """A ToolEnv built the way ``agent.env`` + ``agent.tools`` build one."""

    def __init__(self, tools, bonus: float = 0.0) -> None:
        super().__init__(tools, lambda text, truth: bonus)


def queued(episode_id: str = "e0") -> QueuedEpisode:
    return QueuedEpisode(EpisodeJob(episode_id, TASK), SETTINGS)


async def test_an_environment_that_raises_is_a_failed_episode(renderer, nowhere):
    runner = EpisodeRunner(RaisingEnv, renderer, nowhere, agent())
    outcome = await runner.play(queued(), restarts=1)
    episode = Episode.decode(outcome.episode)
    assert episode.end_reason == EndReason.ERROR and "no such task" in outcome.error
    assert (outcome.restarts, outcome.replica_ids, runner.failed) == (1, [], 1)


async def test_an_environment_that_cannot_be_built_is_a_failed_episode(renderer, nowhere):
    def broken():
        raise ValueError("missing credentials")

    outcome = await EpisodeRunner(broken, renderer, nowhere, agent()).play(queued())
    assert outcome.error == "ValueError: missing credentials"
    assert Episode.decode(outcome.episode).failed


async def test_an_episode_past_its_time_limit_is_a_failed_episode(renderer, nowhere):
    """Building the environment and its reset each fit the step limit; together they do not
    fit the episode's."""

    def slow_to_build():
        time.sleep(0.25)
        return SlowEnv(0.25)

    limits = agent(step_timeout_s=0.4, episode_timeout_s=0.4)
    outcome = await EpisodeRunner(slow_to_build, renderer, nowhere, limits).play(queued())
    assert outcome.error == "episode timed out after 0.4s"
    assert Episode.decode(outcome.episode).failed


async def test_an_unreachable_router_is_a_failed_episode(renderer, nowhere):
    outcome = await EpisodeRunner(SlowEnv, renderer, nowhere, agent()).play(queued())
    assert "Unavailable" in outcome.error and Episode.decode(outcome.episode).failed


def test_the_environment_is_resolved_from_agent_env():
    calc = env_maker(AgentConfig(env="calc", tool_timeout_s=3.0))()
    assert calc.toolbox.timeout_s == 3.0 and [t["function"]["name"] for t in calc.tools] == ["add"]
    config = AgentConfig(
        env="test_env_runner:ToolUser",
        env_kwargs={"bonus": 0.5},
        tools=["test_env_runner:add"],
        tool_timeout_s=2.0,
    )
    env = env_maker(config)()
    assert isinstance(env, ToolUser) and env.answer_checker("", None) == 0.5
    assert (list(env.toolbox.tools), env.toolbox.timeout_s) == (["add"], 2.0)
    with pytest.raises(ValueError, match="cannot load"):
        env_maker(AgentConfig(env="test_env_runner:Missing"))
