"""TRL ``environment_factory`` classes through ``agent.env``: tools from public methods, the
reset observation on the prompt, reward from ``get_reward``, bad output a failed episode.

TRL's convention needs no base class, so the environments here are plain classes written the
way TRL's docs write them; their tool schemas come from ``transformers.utils.get_json_schema``,
which is what TRL uses.
"""

from __future__ import annotations

from typing import Any

import pytest
from agent_fixtures import ScriptedGenerator, agent_tokenizer

from rlfleet.agent.adapters import adapt, load_env_factory
from rlfleet.agent.adapters.trl_env import TRLEnv, is_trl_environment
from rlfleet.agent.episode import EndReason, Episode
from rlfleet.agent.loop import run_episode
from rlfleet.agent.render import ChatRenderer
from rlfleet.agent.tool_calls import parse_tool_calls
from rlfleet.rollout.types import SamplingParams
from rlfleet.tasks import calc

IDEAL = [
    '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>',
    '<tool_call>{"name":"add","arguments":{"a":46,"b":56}}</tool_call>',
    "102",
]


class AdderEnv:
    """A TRL environment: ``add`` is its tool, the reward is whether the last sum is the truth."""

    def __init__(self, hint: str = " Use add.") -> None:
        self.hint, self.truth, self.last, self.calls = hint, None, None, []

    def reset(self, **row: Any) -> str | None:
        self.truth, self.last, self.calls = int(row["reward_model"]["ground_truth"]), None, []
        return self.hint or None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls.append((a, b))
        self.last = a + b
        return self.last

    def get_reward(self) -> float:
        return float(self.last == self.truth)

    @property
    def score(self) -> float:
        raise AssertionError("TRL lists methods on the class: properties are never evaluated")

    def _helper(self) -> None:
        """Private: not a tool."""


class NoRewardEnv:
    def reset(self, **row: Any) -> None:
        return None


class BadResetEnv:
    def reset(self, **row: Any) -> int:
        return 42


def make_adder() -> AdderEnv:
    """A factory (TRL's ``environment_factory`` may be any zero-argument callable)."""
    return AdderEnv(hint="")


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
        episode_id="ep-trl",
    )


def test_a_trl_class_is_recognised_and_its_public_methods_are_the_tools() -> None:
    assert is_trl_environment(AdderEnv) and not is_trl_environment(TRLEnv)
    env = load_env_factory("test_agent_adapters_trl:AdderEnv", {"hint": " Go."})()
    assert isinstance(env, TRLEnv) and env.environment.hint == " Go."
    (schema,) = env.tools
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    made = load_env_factory("test_agent_adapters_trl:make_adder")()
    assert isinstance(made, TRLEnv) and made.environment.hint == ""


async def test_an_episode_calls_the_methods_and_scores_with_get_reward(
    renderer: ChatRenderer,
) -> None:
    env = load_env_factory("test_agent_adapters_trl:AdderEnv")()
    episode = await play(renderer, env, IDEAL)
    assert (episode.end_reason, episode.reward, episode.reward_parts) == (
        EndReason.DONE,
        1.0,
        {"AdderEnv": 1.0},
    )
    assert episode.messages[0] == {"role": "user", "content": "12+34+56= Use add."}
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["46", "102"]
    assert (episode.num_turns, episode.tool_calls, env.environment.calls) == (
        3,
        2,
        [(12, 34), (46, 56)],
    )


async def test_calls_run_in_the_order_written_and_bad_ones_are_observations() -> None:
    env = adapt(AdderEnv())
    await env.reset(prompt="1+2+3=", reward_model={"ground_truth": "6"})
    turn = parse_tool_calls(
        '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name":"add","arguments":{"a":3}}</tool_call>'
        '<tool_call>{"name":"add","arguments":{"a":3,"b":3}}</tool_call>'
    )
    observation, reward, done, info = await env.step(turn.message())
    assert [m["content"][:7] for m in observation] == ["3", "error: ", "error: ", "6"]
    assert "missing required argument(s): b" in observation[2]["content"]
    assert (reward, done, info, env.environment.calls) == (
        0.0,
        False,
        {"tool_errors": 2},
        [(1, 2), (3, 3)],
    )


async def test_without_get_reward_the_episode_ends_at_zero(renderer: ChatRenderer) -> None:
    episode = await play(renderer, TRLEnv(NoRewardEnv()), ["102"])
    assert (episode.end_reason, episode.reward, episode.reward_parts) == (EndReason.DONE, 0.0, {})
    assert episode.messages[0]["content"] == "12+34+56="


async def test_a_reset_that_returns_a_non_message_is_a_failed_episode(
    renderer: ChatRenderer,
) -> None:
    episode = await play(renderer, adapt(BadResetEnv()), IDEAL)
    assert episode.failed and "reset must return None, a string or messages" in episode.error
