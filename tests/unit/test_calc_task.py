"""The calc agent task: problems, the `add` tool and its schema, the checker, the ideal episode
and the committed verl data, as pinned for the tiny tool-using policy."""

import json
from pathlib import Path

import pytest

from rlfleet.tasks.calc import (
    DATA_SOURCE,
    HIGH,
    LOW,
    TOOLS,
    Problem,
    add,
    check_answer,
    from_verl_record,
    ground_truth,
    ideal_messages,
    prompt_messages,
    split_problems,
    to_verl_record,
)

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "calc"


def test_problem_prompt_and_answer():
    p = Problem((12, 34, 56))
    assert p.prompt == "12+34+56=" and p.answer == "102" == ground_truth(p)
    assert prompt_messages(p) == [{"role": "user", "content": "12+34+56="}]
    assert prompt_messages(p, system="s")[0] == {"role": "system", "content": "s"}


def test_split_is_deterministic_disjoint_and_in_range():
    train, test = split_problems(7, 300, 50)
    assert (train, test) == split_problems(7, 300, 50)
    assert train != split_problems(8, 300, 50)[0]
    assert len(set(train)) == 300 and len(set(test)) == 50 and not set(train) & set(test)
    assert {len(p.numbers) for p in train} == {3, 4}
    assert all(LOW <= n <= HIGH for p in train + test for n in p.numbers)
    assert split_problems(7, 10, 50)[1] == test  # the test split ignores n_train


def test_add_and_its_schema():
    from transformers.utils import get_json_schema

    assert add(46, 56) == 102 and TOOLS == [add]
    schema = get_json_schema(add)
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "integer", "description": "The second number."},
        },
        "required": ["a", "b"],
    }


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        ("102", 1.0),
        (" 102\n", 1.0),
        ("The sum is 102.", 1.0),
        ("101", 0.0),
        ("", 0.0),
        ("no number", 0.0),
        ('<tool_call>{"name":"add","arguments":{"a":1,"b":102}}</tool_call>', 0.0),
    ],
)
def test_check_answer(text, reward):
    assert check_answer(text, "102") == reward


def test_check_answer_tolerates_a_bad_truth():
    assert check_answer("102", "n/a") == 0.0


def test_ideal_conversation_calls_add_on_the_running_total():
    messages = ideal_messages(Problem((12, 34, 56, 78)))
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    calls = [m["tool_calls"][0] for m in messages if m.get("tool_calls")]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"a": 12, "b": 34},
        {"a": 46, "b": 56},
        {"a": 102, "b": 78},
    ]
    assert calls[0]["function"]["arguments"] == '{"a":12,"b":34}'
    assert all(c["type"] == "function" and c["function"]["name"] == "add" for c in calls)
    replies = [m for m in messages if m["role"] == "tool"]
    assert [r["content"] for r in replies] == ["46", "102", "180"]
    assert [r["tool_call_id"] for r in replies] == [c["id"] for c in calls]
    assert messages[-1] == {"role": "assistant", "content": "180"}
    assert check_answer(messages[-1]["content"], "180") == 1.0
    assert len([m for m in ideal_messages(Problem((1, 2, 3))) if m["role"] == "assistant"]) == 3


def test_verl_record_round_trip():
    p = Problem((10, 99, 42))
    record = to_verl_record(p, "train", 3)
    assert record["data_source"] == DATA_SOURCE == "calc"
    assert record["prompt"] == prompt_messages(p)
    assert record["reward_model"] == {"style": "rule", "ground_truth": "151"}
    assert record["extra_info"] == {"split": "train", "index": 3, "numbers": [10, 99, 42]}
    assert from_verl_record(record) == p
    assert from_verl_record({"prompt": "10+99+42="}) == p


def test_committed_data_matches_the_generator():
    test_rows = [json.loads(line) for line in (DATA_DIR / "test.jsonl").open()]
    with (DATA_DIR / "train.jsonl").open() as f:
        train_head = [json.loads(next(f)) for _ in range(100)]
    train, test = split_problems(1234, 100, 500)
    assert [from_verl_record(r) for r in test_rows] == test
    assert [from_verl_record(r) for r in train_head] == train
    assert test_rows[0] == to_verl_record(test[0], "test", 0)
