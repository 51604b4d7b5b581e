"""Prompt data in verl's schema from JSONL and Parquet, and how prompts meet chat templates.

The Parquet files are written the way verl's preprocessing scripts write them (a pandas frame
of dicts and lists through pyarrow), so ``prompt`` is a list of ``{role, content}`` structs
and ``reward_model`` a struct; both file types must give the same records and token ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.common.errors import InvalidArgument
from rlfleet.model.model_io import encode_prompt, load_tokenizer, prompt_text
from rlfleet.trainer.data import load_records, read_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "tiny-qwen2-arith"
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def gsm8k_row(index: int, question: str, answer: str) -> dict:
    """One row as verl's ``examples/data_preprocess/gsm8k.py`` writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": "train",
            "index": index,
            "answer": f"... #### {answer}",
            "question": question,
        },
    }


ROWS = [gsm8k_row(0, "1+2=", "3"), gsm8k_row(1, "40+2=", "42")]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pandas as pd

    pd.DataFrame(rows).to_parquet(path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY)


@pytest.fixture(scope="module")
def templated():
    """The tiny tokenizer with a chat template, like an instruct model's."""
    tokenizer = load_tokenizer(TINY)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_parquet_and_jsonl_in_verls_layout_give_the_same_records(tmp_path, tokenizer):
    parquet = load_records([str(write_parquet(tmp_path / "t.parquet", ROWS))], tokenizer, 256)
    jsonl = load_records([str(write_jsonl(tmp_path / "t.jsonl", ROWS))], tokenizer, 256)
    assert [vars(r) for r in parquet] == [vars(r) for r in jsonl]
    first = parquet[0]
    assert first.prompt == ROWS[0]["prompt"] and first.data_source == "openai/gsm8k"
    assert first.ground_truth == "3" and first.extra_info == ROWS[0]["extra_info"]
    assert first.token_ids == encode_prompt(tokenizer, ROWS[0]["prompt"])


def test_parquet_values_come_back_as_plain_python(tmp_path):
    rows = [{"prompt": "7+8=", "data_source": "arith", "reward_model": {"ground_truth": 0.1 + 0.2}}]
    [row] = read_rows(write_parquet(tmp_path / "s.parquet", rows))
    assert row["reward_model"]["ground_truth"] == 0.1 + 0.2  # exact, not rounded by a JSON trip
    [messages] = [r["prompt"] for r in read_rows(write_parquet(tmp_path / "m.parquet", ROWS[:1]))]
    assert type(messages) is list and type(messages[0]) is dict


def test_train_and_val_files_may_mix_types_and_use_home(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write_parquet(tmp_path / "a.parquet", ROWS[:1])
    write_jsonl(tmp_path / "b.jsonl", ROWS[1:])
    records = load_records(["~/a.parquet", "~/b.jsonl"], tokenizer, 256)
    assert [r.ground_truth for r in records] == ["3", "42"]


def test_bad_data_files_are_named(tmp_path, tokenizer):
    with pytest.raises(InvalidArgument, match="data file not found"):
        load_records([str(tmp_path / "missing.parquet")], tokenizer, 256)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1="}\nnot json\n')
    with pytest.raises(InvalidArgument, match="bad.jsonl:2: not JSON"):
        load_records([str(tmp_path / "bad.jsonl")], tokenizer, 256)
    no_truth = [{"prompt": "1+1=", "data_source": "arith"}]
    with pytest.raises(InvalidArgument, match=r"n.parquet:1: missing field 'reward_model'"):
        load_records([str(write_parquet(tmp_path / "n.parquet", no_truth))], tokenizer, 256)


MESSAGES = [{"role": "user", "content": "1+2="}]


@pytest.mark.parametrize(
    ("mode", "prompt", "text"),
    [
        ("auto", MESSAGES, "<user>1+2=<assistant>"),
        ("auto", "1+2=", "1+2="),
        (True, MESSAGES, "<user>1+2=<assistant>"),
        (True, "1+2=", "<user>1+2=<assistant>"),
        (False, MESSAGES, "1+2="),
        (False, "1+2=", "1+2="),
    ],
)
def test_chat_template_modes(templated, mode, prompt, text):
    assert prompt_text(templated, prompt, mode) == text


def test_without_a_template_auto_joins_messages_and_true_is_an_error(tokenizer):
    assert prompt_text(tokenizer, MESSAGES, "auto") == "1+2="
    with pytest.raises(InvalidArgument, match="no chat template"):
        prompt_text(tokenizer, MESSAGES, True)


def test_load_records_applies_the_configured_mode(tmp_path, templated):
    files = [str(write_jsonl(tmp_path / "t.jsonl", ROWS[:1]))]
    on, off = (load_records(files, templated, 256, mode)[0] for mode in ("auto", False))
    assert on.token_ids == encode_prompt(templated, prompt_text(templated, ROWS[0]["prompt"]))
    assert off.token_ids == encode_prompt(templated, ROWS[0]["prompt"][0]["content"])
    assert on.token_ids != off.token_ids


def test_apply_chat_template_config_values():
    from rlfleet.common.config import load_config

    values = [
        load_config(None, [f"data.apply_chat_template={v}"], env={})
        for v in ("auto", "true", "false")
    ]
    assert [c.data.apply_chat_template for c in values] == ["auto", True, False]
    with pytest.raises(ValueError, match="apply_chat_template"):
        load_config(None, ["data.apply_chat_template=sometimes"], env={})
