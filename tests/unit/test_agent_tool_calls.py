"""Hermes/Qwen tool-call parsing: good calls become OpenAI tool_calls, broken ones error records."""

from __future__ import annotations

import json

import pytest

from rlfleet.agent.tool_calls import ERRORS_KEY, errors_of, parse_tool_calls


def test_one_call_becomes_an_openai_tool_call() -> None:
    turn = parse_tool_calls('<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>')
    assert turn.content == "" and turn.errors == []
    assert turn.tool_calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a":12,"b":34}'},
        }
    ]
    assert turn.message() == {"role": "assistant", "content": "", "tool_calls": turn.tool_calls}


def test_several_calls_with_content_and_whitespace() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        '</tool_call>\n<tool_call> {"name": "mul", "arguments": {"x": [1, 2]}} </tool_call>'
    )
    turn = parse_tool_calls(text, first_index=4)
    assert turn.content == "Let me add."
    assert [c["id"] for c in turn.tool_calls] == ["call_4", "call_5"]
    assert [c["function"]["name"] for c in turn.tool_calls] == ["add", "mul"]
    assert json.loads(turn.tool_calls[1]["function"]["arguments"]) == {"x": [1, 2]}
    assert turn.attempted == 2


def test_text_without_calls_is_all_content() -> None:
    turn = parse_tool_calls("102")
    assert turn.content == "102" and turn.attempted == 0
    assert turn.message() == {"role": "assistant", "content": "102"}


def test_arguments_as_a_json_string_or_absent_are_accepted() -> None:
    turn = parse_tool_calls(
        '<tool_call>{"name":"add","arguments":"{\\"a\\":1}"}</tool_call>'
        '<tool_call>{"name":"now"}</tool_call>'
    )
    assert [c["function"]["arguments"] for c in turn.tool_calls] == ['{"a":1}', "{}"]


@pytest.mark.parametrize(
    ("inside", "reason"),
    [
        ('{"name":"add","arguments":{"a":1', "not valid JSON"),
        ('["add", 1]', "JSON object"),
        ('{"arguments":{"a":1}}', "no name"),
        ('{"name":"","arguments":{}}', "no name"),
        ('{"name":"add","arguments":[1,2]}', "arguments must be a JSON object"),
        ('{"name":"add","arguments":"not json"}', "arguments must be a JSON object"),
    ],
)
def test_malformed_calls_are_error_records(inside: str, reason: str) -> None:
    text = f'<tool_call>{{"name":"ok","arguments":{{}}}}</tool_call><tool_call>{inside}</tool_call>'
    turn = parse_tool_calls(text)
    assert [c["id"] for c in turn.tool_calls] == ["call_0"]
    (error,) = turn.errors
    assert (error.id, error.index, error.raw) == ("call_1", 1, inside)
    assert reason in error.reason
    assert errors_of(turn.message()) == [error]


def test_an_unclosed_call_is_an_error_record() -> None:
    turn = parse_tool_calls('<tool_call>{"name":"add","arguments":{"a":1,"b":2}}')
    assert turn.tool_calls == [] and "no closing" in turn.errors[0].reason
    assert ERRORS_KEY in turn.message()


def test_garbage_never_raises() -> None:
    for text in [
        "<tool_call>",
        "</tool_call><tool_call></tool_call>",
        "<tool_call>\x00</tool_call>",
        "<tool_call><tool_call>{}</tool_call>",
        "{" * 10_000,
    ]:
        turn = parse_tool_calls(text)
        assert turn.tool_calls == [] or turn.errors == []
