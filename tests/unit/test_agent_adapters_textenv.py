"""A Gymnasium-shaped text environment (the TextEnv protocol itself) through ``agent.env``: the
dispatch leaves it as it is, a class or what a factory makes, and one that never ends stops at
``max_turns``, one that answers a non-message is a failed episode."""

from __future__ import annotations

from typing import Any

import pytest
from agent_fixtures import ScriptedGenerator, agent_tokenizer

from rlfleet.agent.adapters import load_env_factory
from rlfleet.agent.environment import task_prompt
from rlfleet.agent.episode import EndReason, Episode
from rlfleet.agent.loop import run_episode
from rlfleet.agent.render import ChatRenderer
from rlfleet.rollout.types import SamplingParams


class CountdownEnv:
    """Gymnasium's shape over messages: the user counts down from ``start``; the assistant must
    say each next number; a wrong one ends the episode at reward 0."""

    def __init__(self, start: int = 3) -> None:
        self.start = self.left = start

    def reset(self, **task: Any) -> list[dict]:
        self.left = self.start
        return task_prompt({"prompt": str(self.start)})

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        expected = str(self.left - 1)
        if message["content"] != expected:
            return [], 0.0, True, {"reward_parts": {"count": 0.0}}
        self.left -= 1
        if self.left == 0:
            return [], 1.0, True, {"reward_parts": {"count": 1.0}}
        return [{"role": "user", "content": str(self.left)}], 0.0, False, {}


class EndlessEnv(CountdownEnv):
    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        return [{"role": "user", "content": "1"}], 0.0, False, {}


class ChattyEnv(CountdownEnv):
    def step(self, message: dict) -> Any:
        return "1", 0.0, False, {}


def make_countdown(start: int) -> CountdownEnv:
    return CountdownEnv(start)


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(agent_tokenizer())


async def play(renderer: ChatRenderer, env: Any, turns: list[str]) -> Episode:
    return await run_episode(
        env,
        {},
        ScriptedGenerator(turns),
        renderer,
        max_turns=4,
        max_episode_tokens=512,
        sampling=SamplingParams(max_tokens=16),
        episode_id="ep-gym",
    )


async def test_a_text_env_class_runs_as_it_is(renderer: ChatRenderer) -> None:
    env = load_env_factory("test_agent_adapters_textenv:CountdownEnv", {"start": 3})()
    assert type(env) is CountdownEnv and env.start == 3
    episode = await play(renderer, env, ["2", "1", "0"])
    assert (episode.end_reason, episode.reward, episode.num_turns) == (EndReason.DONE, 1.0, 3)
    assert [m["content"] for m in episode.messages] == ["3", "2", "2", "1", "1", "0"]


async def test_a_factory_of_text_envs_runs_what_it_makes(renderer: ChatRenderer) -> None:
    env = load_env_factory("test_agent_adapters_textenv:make_countdown", {"start": 2})()
    assert type(env) is CountdownEnv and env.start == 2
    episode = await play(renderer, env, ["1", "5"])
    assert (episode.end_reason, episode.reward, episode.reward_parts) == (
        EndReason.DONE,
        0.0,
        {"count": 0.0},
    )


async def test_an_env_that_never_ends_stops_at_max_turns(renderer: ChatRenderer) -> None:
    env = load_env_factory("test_agent_adapters_textenv:EndlessEnv")()
    episode = await play(renderer, env, ["2"])
    assert (episode.end_reason, episode.num_turns, episode.failed) == (
        EndReason.MAX_TURNS,
        4,
        False,
    )
    chatty = await play(
        renderer, load_env_factory("test_agent_adapters_textenv:ChattyEnv")(), ["2"]
    )
    assert chatty.failed and "step must return a list of messages, got str" in chatty.error
