"""``trainer.mode: sft`` through the whole fleet (`rlfleet up`): the tiny policy learns the
demonstrated answers of the arith train set, every step's weights reach the replica, and the
held-out accuracy measured through the replica rises; a conversation with no assistant turn is
refused before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import ROOT
from up_proc import failure_report, read_metrics, run_up

pytestmark = pytest.mark.slow

STEPS = 30
HELD_OUT = "val-core/arith/reward/mean@1"


def sft_rows(path: Path, count: int) -> Path:
    """The first ``count`` arith train prompts, each with its answer as the assistant turn."""
    rows = [json.loads(line) for line in (ROOT / "data/arith/train.jsonl").open()][:count]
    with path.open("w") as out:
        for row in rows:
            out.write(json.dumps({**row, "response": row["reward_model"]["ground_truth"]}) + "\n")
    return path


def test_an_sft_run_learns_the_demonstrations_and_serves_them(tmp_path):
    run_dir = tmp_path / "run"
    data = sft_rows(tmp_path / "sft.jsonl", 2000)
    extra = [
        f"data.train_files=[{data}]",
        "trainer.mode=sft",
        "trainer.lr=1e-4",
        "data.train_batch_size=32",
        "data.val_size=128",
        f"trainer.test_freq={STEPS // 2}",
        "--rollout-replicas",
        "1",
    ]
    result = run_up(run_dir, "hf", steps=STEPS, extra=extra)
    assert result.returncode == 0, failure_report(result, run_dir)
    metrics = read_metrics(run_dir)
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["training/weight_version"] for m in steps] == [float(v) for v in range(2, STEPS + 2)]
    assert all(32 * 2 < m["sft/trained_tokens"] <= 32 * 4 for m in steps)  # digits, <eos>
    first, last = steps[0]["train/loss"], steps[-1]["train/loss"]
    assert last < first, (first, last)
    middle = [m for m in metrics if HELD_OUT in m]
    assert middle and middle[0]["val/weight_version"] == STEPS // 2 + 1  # the version just trained
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["val_before"][HELD_OUT], summary["val_after"][HELD_OUT]
    assert after >= before + 0.1, (before, after)  # measured through the replica's weights
    assert summary["val_weight_version"] == STEPS + 1
    assert not (run_dir / "logs" / "refcritic.log").exists()
    assert (Path(summary["checkpoint"]) / "model.safetensors").is_file()


def test_an_sft_file_without_an_assistant_turn_is_refused(tmp_path):
    data = tmp_path / "prompts_only.jsonl"
    data.write_text((ROOT / "data/arith/train.jsonl").read_text().splitlines()[0] + "\n")
    run_dir = tmp_path / "run"
    result = run_up(
        run_dir,
        "hf",
        steps=1,
        extra=[f"data.train_files=[{data}]", "trainer.mode=sft", "--rollout-replicas", "1"],
    )
    assert result.returncode != 0
    assert "prompts_only.jsonl:1: an SFT row has no assistant turn" in result.stdout + result.stderr


def test_an_rl_run_warms_up_on_demonstrations_first(tmp_path):
    """``trainer.sft_warmup_steps``: the first steps are supervised (their rows carry
    ``sft/*``), RL follows in the same run (async) with the next weight versions, and the
    warm-up's steps count in ``total_steps``."""
    run_dir, warmup, steps = tmp_path / "run", 3, 6
    data = sft_rows(tmp_path / "sft.jsonl", 200)
    extra = [
        f"data.sft_files=[{data}]",
        f"trainer.sft_warmup_steps={warmup}",
        "data.sft_batch_size=16",
        "trainer.mode=async",
        "trainer.lr=1e-4",
        "data.val_size=32",
        f"trainer.test_freq={warmup}",
    ]
    result = run_up(run_dir, "hf", steps=steps, extra=extra, replicas=1)
    assert result.returncode == 0, failure_report(result, run_dir)
    rows = [m for m in read_metrics(run_dir) if "training/global_step" in m]
    assert [m["training/global_step"] for m in rows] == [float(s) for s in range(1, steps + 1)]
    supervised = [m for m in rows if "sft/trained_tokens" in m]
    assert supervised == rows[:warmup] and all(m["sft/trained_tokens"] > 16 for m in supervised)
    assert all("critic/score/mean" in m and "sft/trained_tokens" not in m for m in rows[warmup:])
    assert [m["training/weight_version"] for m in supervised] == [2.0, 3.0, 4.0]
    assert min(m["training/weight_version"] for m in rows[warmup:]) > 4.0
    validated = [m for m in read_metrics(run_dir) if HELD_OUT in m]
    assert validated and validated[0]["val/weight_version"] == warmup + 1  # the warmed-up weights
