"""Tools: schemas from typed functions, and every failure of a call as an ``error:`` observation."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlfleet.agent.tool_calls import parse_tool_calls
from rlfleet.agent.tools import ToolBox, check_arguments, load_object, make_tool, tool_schema


def scale(values: list[float], factor: float = 2.0, label: str | None = None) -> dict:
    """Multiply numbers by a factor.

    Args:
        values: The numbers.
        factor: What to multiply by.
        label: An optional name for the result.
    """
    return {"label": label, "values": [v * factor for v in values]}


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def hang(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "late"


async def ahang(seconds: float) -> str:
    """Sleep without blocking, then answer.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return "late"


def undocumented(x: int) -> int:
    return x


def call(name: str, arguments: str, call_id: str = "call_0") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_schema_from_a_typed_function() -> None:
    schema = tool_schema(scale)
    function = schema["function"]
    assert schema["type"] == "function" and function["name"] == "scale"
    assert function["description"] == "Multiply numbers by a factor."
    assert function["parameters"]["required"] == ["values"]
    assert function["parameters"]["properties"]["values"]["type"] == "array"


def test_a_tool_by_import_path_and_a_schema_that_does_not_parse() -> None:
    tool = make_tool("rlfleet.tasks.calc:add")
    assert tool.name == "add" and tool.path == "rlfleet.tasks.calc:add"
    with pytest.raises(ValueError, match="undocumented: no schema"):
        ToolBox([undocumented])
    with pytest.raises(ValueError, match="module:attr"):
        load_object("rlfleet.tasks.calc.add")
    with pytest.raises(ValueError, match="cannot load"):
        load_object("rlfleet.tasks.calc:nothing_here")


def test_arguments_are_checked_against_the_schema() -> None:
    parameters = tool_schema(scale)["function"]["parameters"]
    assert check_arguments(parameters, {"values": [1, 2.5]}) is None
    assert check_arguments(parameters, {"values": [1], "label": None}) is None
    assert "missing required" in check_arguments(parameters, {"factor": 2})
    assert "unknown argument" in check_arguments(parameters, {"values": [], "scale": 1})
    assert "type array" in check_arguments(parameters, {"values": "1,2"})
    assert "type number" in check_arguments(parameters, {"values": [True]})
    ints = tool_schema(divide)["function"]["parameters"]
    assert "type integer" in check_arguments(ints, {"a": 1.5, "b": 2})
    assert "type integer" in check_arguments(ints, {"a": True, "b": 2})


async def test_a_good_call_answers_with_a_tool_message() -> None:
    box = ToolBox(["rlfleet.tasks.calc:add", scale])
    reply = await box.run(call("add", '{"a":12,"b":34}'))
    assert reply == {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "46"}
    reply = await box.run(call("scale", '{"values":[1,2]}', "call_1"))
    assert reply["content"] == '{"label": null, "values": [2.0, 4.0]}'
    assert (box.calls, box.errors) == (2, 0)
    assert [s["function"]["name"] for s in box.schemas] == ["add", "scale"]


@pytest.mark.parametrize(
    ("the_call", "expected"),
    [
        (call("nope", "{}"), "unknown tool 'nope'"),
        (call("divide", '{"a": 1}'), "missing required argument(s): b"),
        (call("divide", '{"a": "1", "b": 2}'), "argument a must be of type integer"),
        (call("divide", "[1, 2]"), "arguments must be a JSON object"),
        (call("divide", '{"a": 1, "b": 0}'), "divide raised ZeroDivisionError"),
    ],
)
async def test_failures_are_error_observations(the_call: dict, expected: str) -> None:
    box = ToolBox([divide])
    reply = await box.run(the_call)
    assert reply["role"] == "tool" and reply["tool_call_id"] == "call_0"
    assert reply["content"].startswith("error: ") and expected in reply["content"]
    assert (box.calls, box.errors) == (1, 1)


@pytest.mark.parametrize("tool", [hang, ahang])
async def test_a_hanging_tool_times_out_as_an_observation(tool: object) -> None:
    box = ToolBox([tool], timeout_s=0.2)
    started = time.perf_counter()
    reply = await box.run(call(tool.__name__, '{"seconds": 30}'))
    assert time.perf_counter() - started < 2
    assert reply["content"] == f"error: {tool.__name__} timed out after 0.2s"
    assert box.errors == 1


async def test_answer_covers_good_and_malformed_calls_in_order() -> None:
    text = (
        '<tool_call>{"name":"divide","arguments":{"a":6,"b":3}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name":"divide","arguments":{"a":1,"b":0}}</tool_call>'
    )
    box = ToolBox([divide])
    answers = await box.answer(parse_tool_calls(text, first_index=8).message())
    assert [m["tool_call_id"] for m in answers.messages] == ["call_8", "call_9", "call_10"]
    assert answers.messages[0]["content"] == "2.0"
    assert answers.messages[1]["content"].startswith("error: malformed tool call")
    assert answers.errors == 2 and box.calls == 3


async def test_sandboxed_tools_run_in_a_confined_child() -> None:
    from rlfleet.common.config import SandboxLimits

    limits = SandboxLimits(cpu_s=5.0, memory_mb=1024)
    box = ToolBox(
        ["rlfleet.tasks.calc:add", divide, hang], sandbox=True, timeout_s=3.0, limits=limits
    )
    replies = await asyncio.gather(
        box.run(call("add", '{"a":12,"b":34}')),
        box.run(call("divide", '{"a":1,"b":0}', "call_1")),
        box.run(call("hang", '{"seconds": 60}', "call_2")),
    )
    assert [r["content"] for r in replies] == [
        "46",
        "error: divide failed: ZeroDivisionError: division by zero",
        "error: hang timed out after 3s",
    ]
    with pytest.raises(ValueError, match="async tools cannot run sandboxed"):
        ToolBox([ahang], sandbox=True)
