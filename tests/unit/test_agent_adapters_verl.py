"""verl tools YAML files with ``BaseTool``-shaped classes (verl is not installed: the classes
here have its shape): loaded into a ToolBox, each call create -> execute -> release, a failing
tool an error observation, a bad file or schema a ValueError naming the entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from agent_fixtures import ScriptedGenerator, agent_tokenizer

from rlfleet.agent.adapters.verl_tools import is_tool_config, load_tool_config, load_toolbox
from rlfleet.agent.environment import ToolEnv
from rlfleet.agent.episode import EndReason
from rlfleet.agent.loop import run_episode
from rlfleet.agent.render import ChatRenderer
from rlfleet.rollout.types import SamplingParams
from rlfleet.tasks import calc

LIFECYCLE: list[tuple[str, str]] = []
ADD_SCHEMA = """
    tool_schema:
      type: function
      function:
        name: add
        description: Add two integers.
        parameters:
          type: object
          properties:
            a: {type: integer, description: The first number.}
            b: {type: integer, description: The second number.}
          required: [a, b]
"""


class ToolResponse:
    """verl's ToolResponse, as far as the agent loop reads it."""

    def __init__(self, text: str | None = None) -> None:
        self.text = text


class AddTool:
    """Shaped like verl's BaseTool: config and schema at construction, async lifecycle."""

    def __init__(self, config: dict, tool_schema: Any) -> None:
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema.function.name  # what verl's BaseTool.__init__ reads
        self._instances: dict[str, list] = {}

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = []
        LIFECYCLE.append(("create", instance_id))
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple:
        LIFECYCLE.append(("execute", instance_id))
        if self.config.get("fail"):
            raise RuntimeError("backend down")
        total = parameters["a"] + parameters["b"] + self.config.get("offset", 0)
        return ToolResponse(str(total)), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        LIFECYCLE.append(("release", instance_id))
        self._instances.pop(instance_id)


def write(tmp_path: Path, body: str, name: str = "tools.yaml") -> str:
    path = tmp_path / name
    path.write_text(body)
    return str(path)


def tools_file(tmp_path: Path, config: str = "{type: native}") -> str:
    return write(
        tmp_path,
        "tools:\n  - class_name: test_agent_adapters_verl.AddTool\n"
        f"    config: {config}\n" + ADD_SCHEMA,
    )


def double(x: int) -> int:
    """Double a number.

    Args:
        x: The number.
    """
    return 2 * x


def test_a_tools_file_loads_with_its_schemas(tmp_path: Path) -> None:
    path = tools_file(tmp_path, "{type: native, offset: 0}")
    assert is_tool_config(path) and not is_tool_config("rlfleet.tasks.calc:add")
    (tool,) = load_tool_config(path)
    assert tool.name == "add" and tool.parameters["required"] == ["a", "b"]
    box = load_toolbox([path, "test_agent_adapters_verl:double"])
    assert sorted(box.tools) == ["add", "double"]
    with pytest.raises(ValueError, match="named twice"):
        load_toolbox([path, path])


async def test_an_episode_calls_the_verl_tool_through_its_lifecycle(tmp_path: Path) -> None:
    LIFECYCLE.clear()
    env = ToolEnv(load_toolbox([tools_file(tmp_path)]), calc.check_answer)
    generate = ScriptedGenerator(
        [
            '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>',
            '<tool_call>{"name":"add","arguments":{"a":46,"b":56}}</tool_call>',
            "102",
        ]
    )
    episode = await run_episode(
        env,
        calc.to_verl_record(calc.Problem((12, 34, 56)), "test", 0),
        generate,
        ChatRenderer(agent_tokenizer()),
        max_turns=6,
        max_episode_tokens=512,
        sampling=SamplingParams(max_tokens=64),
        episode_id="ep-verl",
    )
    assert (episode.end_reason, episode.reward, episode.tool_errors) == (EndReason.DONE, 1.0, 0)
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["46", "102"]
    assert [step for step, _ in LIFECYCLE] == ["create", "execute", "release"] * 2
    assert LIFECYCLE[0][1] == LIFECYCLE[2][1] != LIFECYCLE[3][1]  # one instance per call


async def test_a_tool_that_raises_is_an_error_observation_and_still_released(
    tmp_path: Path,
) -> None:
    LIFECYCLE.clear()
    box = load_toolbox([tools_file(tmp_path, "{type: native, fail: true}")])
    answer = await box.answer(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a":1,"b":2}'},
                }
            ],
        }
    )
    assert answer.errors == 1
    assert answer.messages[0]["content"] == "error: add raised RuntimeError: backend down"
    assert [step for step, _ in LIFECYCLE] == ["create", "execute", "release"]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("tools: 3\n", "a list under `tools:`"),
        ("tools:\n  - config: {}\n", "needs a class_name"),
        ("tools:\n  - class_name: nowhere.Tool\n", "cannot load 'nowhere.Tool'"),
        (
            "tools:\n  - class_name: test_agent_adapters_verl.AddTool\n    config: {type: mcp}\n",
            "only native tools",
        ),
        (
            "tools:\n  - class_name: test_agent_adapters_verl.AddTool\n    tool_schema:\n"
            "      type: function\n      function: {description: no name}\n",
            "AddTool(...) raised",
        ),
        (
            "tools:\n  - class_name: test_agent_adapters_verl.AddTool\n    tool_schema:\n"
            "      function: {name: add, parameters: {type: array}}\n",
            "must be an object schema",
        ),
    ],
)
def test_a_bad_tools_file_names_the_entry(tmp_path: Path, body: str, error: str) -> None:
    with pytest.raises(ValueError, match="tools.yaml") as caught:
        load_tool_config(write(tmp_path, body))
    assert error in str(caught.value)
