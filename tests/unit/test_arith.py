"""The arithmetic task's definitions: prompts, splits, parsing, scoring and verl records."""

import json
from pathlib import Path

import pytest

from rlfleet.tasks.arith import (
    Problem,
    from_verl_record,
    parse_answer,
    score,
    split_problems,
    to_verl_record,
)

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "arith"


def test_problem_prompt_and_answer():
    p = Problem(12, 34)
    assert p.prompt == "12+34="
    assert p.answer == "46"
    assert Problem(99, 99).answer == "198"
    assert Problem(0, 7).prompt == "0+7="


def test_split_is_deterministic_and_disjoint():
    train, test = split_problems(7, 300, 50)
    again_train, again_test = split_problems(7, 300, 50)
    assert (train, test) == (again_train, again_test)
    assert len(train) == 300 and len(test) == 50
    assert len(set(train)) == 300 and len(set(test)) == 50
    assert not set(train) & set(test)


def test_split_depends_on_seed_and_respects_digits():
    train_a, _ = split_problems(1, 100, 10)
    train_b, _ = split_problems(2, 100, 10)
    assert train_a != train_b
    train, test = split_problems(0, 60, 40, digits=1)
    assert all(0 <= p.a <= 9 and 0 <= p.b <= 9 for p in train + test)
    assert len(set(train + test)) == 100


def test_split_rejects_too_many():
    with pytest.raises(ValueError):
        split_problems(0, 90, 20, digits=1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("46", 46),
        ("  46\n", 46),
        ("46<eos>junk", 46),
        ("046", 46),
        ("-3", -3),
        ("", None),
        ("abc 46", None),
        ("+", None),
    ],
)
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


def test_score():
    assert score("46", "46") == 1.0
    assert score(" 46 extra", "46") == 1.0
    assert score("47", "46") == 0.0
    assert score("", "46") == 0.0
    assert score("46", "not a number") == 0.0
    assert isinstance(score("1", "1"), float)


def test_verl_record_schema_and_round_trip():
    p = Problem(5, 93)
    record = to_verl_record(p, "test", 3)
    assert record == {
        "data_source": "arith",
        "prompt": [{"role": "user", "content": "5+93="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "98"},
        "extra_info": {"split": "test", "index": 3},
    }
    assert json.loads(json.dumps(record)) == record
    assert from_verl_record(record) == p


def test_committed_data_matches_generator():
    """The committed JSONL files are exactly what the seeded generator writes."""
    train = [json.loads(line) for line in (DATA_DIR / "train.jsonl").open()]
    test = [json.loads(line) for line in (DATA_DIR / "test.jsonl").open()]
    want_train, want_test = split_problems(1234, 4000, 500)
    assert [from_verl_record(r) for r in train] == want_train
    assert [from_verl_record(r) for r in test] == want_test
    assert all(
        score(r["reward_model"]["ground_truth"], r["reward_model"]["ground_truth"]) for r in test
    )
