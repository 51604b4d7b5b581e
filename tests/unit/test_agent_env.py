"""The text-environment protocol's checks, ToolEnv, and naming an environment in ``agent.env``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rlfleet.agent.adapters import load_env_factory
from rlfleet.agent.environment import (
    EnvError,
    ToolEnv,
    check_step,
    task_prompt,
    task_truth,
)
from rlfleet.agent.tool_calls import parse_tool_calls
from rlfleet.tasks import calc


class EchoEnv:
    """A sync text env with a keyword argument, named by import path in the test below."""

    def __init__(self, reply: str = "ok") -> None:
        self.reply = reply

    def reset(self, **task: Any) -> list[dict]:
        return task_prompt(task)

    def step(self, message: dict) -> tuple:
        return [{"role": "user", "content": self.reply}], 0.0, False, {}


def test_check_step_takes_gymnasium_numpy_scalars() -> None:
    messages, reward, done, info = check_step(([], np.float32(0.5), np.bool_(True), None))
    assert (messages, reward, done, info) == ([], 0.5, True, {})
    assert type(done) is bool and type(reward) is float
    with pytest.raises(EnvError, match="done must be a bool"):
        check_step(([], 0.0, "no", {}))


def test_task_rows_in_verl_schema_and_plain() -> None:
    row = calc.to_verl_record(calc.Problem((12, 34, 56)), "test", 0)
    assert task_prompt(row) == [{"role": "user", "content": "12+34+56="}]
    assert task_truth(row) == "102"
    assert task_prompt({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert task_truth({"ground_truth": 3}) == 3
    with pytest.raises(EnvError):
        task_prompt({"prompt": [{"role": "user"}]})


async def test_tool_env_answers_calls_then_scores_the_answer() -> None:
    env = ToolEnv([calc.add], calc.check_answer)
    assert [s["function"]["name"] for s in env.tools] == ["add"]
    await env.reset(**calc.to_verl_record(calc.Problem((12, 34, 56)), "test", 0))
    turn = parse_tool_calls(
        '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>'
        "<tool_call>{bad}</tool_call>"
    )
    observation, reward, done, info = await env.step(turn.message())
    assert [m["content"][:6] for m in observation] == ["46", "error:"]
    assert (reward, done, info) == (0.0, False, {"tool_errors": 1})
    _, reward, done, info = await env.step({"role": "assistant", "content": "102"})
    assert (reward, done, info["reward_parts"]) == (1.0, True, {"answer": 1.0})


def test_load_env_factory_by_builtin_name_and_import_path() -> None:
    make = load_env_factory("calc", {"timeout_s": 2.0})
    first, second = make(), make()
    assert first is not second and first.toolbox is second.toolbox
    assert first.toolbox.timeout_s == 2.0
    echo = load_env_factory("test_agent_env:EchoEnv", {"reply": "again"})()
    assert isinstance(echo, EchoEnv) and echo.reply == "again"
    with pytest.raises(ValueError, match="cannot load"):
        load_env_factory("test_agent_env:Missing")
    with pytest.raises(ValueError, match="not a class or a factory"):
        load_env_factory("rlfleet.tasks.calc:DATA_SOURCE")
