"""skyrl-gym ``BaseTextEnv`` subclasses through ``agent.env``, with the real skyrl-gym package:
built per episode from the row (``env_config``, ``extras``), raw text in, per-step rewards
summed, ``close`` at done, bad output a failed episode."""

from __future__ import annotations

from typing import Any

import pytest
from agent_fixtures import ScriptedGenerator, agent_tokenizer

pytest.importorskip("skyrl_gym")
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput  # noqa: E402

from rlfleet.agent.adapters import load_env_factory  # noqa: E402
from rlfleet.agent.adapters.skyrl_env import SkyRLTextEnv, extras_of, is_skyrl_env  # noqa: E402
from rlfleet.agent.episode import EndReason, Episode  # noqa: E402
from rlfleet.agent.loop import run_episode  # noqa: E402
from rlfleet.agent.render import ChatRenderer  # noqa: E402
from rlfleet.rollout.types import SamplingParams  # noqa: E402
from rlfleet.tasks import calc  # noqa: E402

CLOSED: list[str] = []


class SumEnv(BaseTextEnv):
    """Multi-turn: the model names the sum; a wrong answer earns a hint and 0.1 for trying, the
    right one 1.0 and the end; ``env_config.max_turns`` caps it, as skyrl-gym's envs do."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.truth = str(extras["reward_spec"]["ground_truth"])
        self.max_turns = env_config.max_turns
        self.actions: list[str] = []

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        self.actions.append(action)
        done = action.strip() == self.truth or self.turns >= self.max_turns
        reward = 1.0 if action.strip() == self.truth else 0.1
        observations = [] if done else [{"role": "user", "content": "try again"}]
        return BaseTextEnvStepOutput(
            observations=observations, reward=reward, done=done, metadata={"turn": self.turns}
        )

    def close(self) -> None:
        CLOSED.append(self.truth)


class BrokenEnv(BaseTextEnv):
    def step(self, action: str) -> Any:
        return "not a step output"


def make_broken() -> BrokenEnv:
    return BrokenEnv()


@pytest.fixture(scope="module")
def renderer() -> ChatRenderer:
    return ChatRenderer(agent_tokenizer())


async def play(renderer: ChatRenderer, env: Any, turns: list[str]) -> Episode:
    row = calc.to_verl_record(calc.Problem((12, 34, 56)), "test", 0)
    return await run_episode(
        env,
        row,
        ScriptedGenerator(turns),
        renderer,
        max_turns=6,
        max_episode_tokens=512,
        sampling=SamplingParams(max_tokens=64),
        episode_id="ep-skyrl",
    )


def test_a_base_text_env_subclass_is_recognised() -> None:
    assert is_skyrl_env(SumEnv) and not is_skyrl_env(SkyRLTextEnv)
    env = load_env_factory("test_agent_adapters_skyrl:SumEnv", {"max_turns": 3})()
    assert isinstance(env, SkyRLTextEnv) and env.env_class is SumEnv and env.env is None
    row = {"prompt": "1+1=", "reward_model": {"ground_truth": "2"}, "extra_info": {"i": 0}}
    assert extras_of(row) == {
        "reward_model": {"ground_truth": "2"},
        "extra_info": {"i": 0},
        "reward_spec": {"method": "rule", "ground_truth": "2"},
    }


async def test_an_episode_sums_step_rewards_and_closes_the_env(renderer: ChatRenderer) -> None:
    CLOSED.clear()
    env = load_env_factory("test_agent_adapters_skyrl:SumEnv", {"max_turns": 4})()
    tool_text = '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>'
    episode = await play(renderer, env, ["100", tool_text, "102"])
    assert (episode.end_reason, episode.num_turns) == (EndReason.DONE, 3)
    assert episode.reward == pytest.approx(1.2)
    assert env.env.actions == ["100", tool_text, "102"]  # raw text, tool calls as written
    assert [m["content"] for m in episode.messages if m["role"] == "user"][1:] == ["try again"] * 2
    await env.close()  # the env worker closes every episode's environment: once is enough
    assert CLOSED == ["102"]


async def test_a_step_that_returns_a_non_step_output_is_a_failed_episode(
    renderer: ChatRenderer,
) -> None:
    episode = await play(
        renderer, load_env_factory("test_agent_adapters_skyrl:make_broken")(), ["102"]
    )
    assert episode.failed and "step must return a BaseTextEnvStepOutput" in episode.error
