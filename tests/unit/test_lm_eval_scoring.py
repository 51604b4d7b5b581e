"""examples/lm_eval/score_checkpoint.py: what it reads from a run and from lm_eval's output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "lm_eval" / "score_checkpoint.py"


@pytest.fixture(scope="module")
def scoring():
    spec = importlib.util.spec_from_file_location("score_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trainers_number_is_its_held_out_accuracy_after_training(scoring, tmp_path):
    summary = {"val_before": {scoring.ACCURACY_KEY: 0.17}, "val_after": {scoring.ACCURACY_KEY: 0.6}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert scoring.trainer_number(tmp_path) == 0.6
    (tmp_path / "summary.json").write_text(json.dumps({"val_after": {}}))
    with pytest.raises(SystemExit, match="no val_after"):
        scoring.trainer_number(tmp_path)


def test_the_chat_url_is_the_routers_openai_front(scoring):
    endpoints = {"router": {"grpc": "127.0.0.1:1", "http": "http://127.0.0.1:8000/v1"}}
    assert scoring.chat_url(endpoints) == "http://127.0.0.1:8000/v1/chat/completions"


def test_lm_evals_newest_results_file_gives_the_accuracy(scoring, tmp_path):
    older = tmp_path / "policy" / "results_1.json"
    older.parent.mkdir()
    older.write_text(json.dumps({"results": {"rlfleet_basic_math": {"acc,none": 0.1}}}))
    newer = tmp_path / "policy" / "results_2.json"
    newer.write_text(json.dumps({"results": {"rlfleet_basic_math": {"acc,none": 0.625}}}))
    assert scoring.lm_eval_accuracy(tmp_path) == 0.625
    with pytest.raises(SystemExit, match="no results"):
        scoring.lm_eval_accuracy(tmp_path / "empty")


def test_the_lm_eval_command_is_the_readmes(scoring, tmp_path):
    argv = scoring.lm_eval_argv("http://h/v1/chat/completions", "final", 256, tmp_path, 8)
    text = " ".join(argv)
    assert "--model local-chat-completions --apply_chat_template" in text
    assert "base_url=http://h/v1/chat/completions,model=final,num_concurrent=8" in text
    assert "--tasks rlfleet_basic_math --limit 256" in text
