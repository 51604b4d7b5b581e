"""One run, one record: a fresh run in a used ``run_dir`` moves the previous run's files into
``run_dir/previous/<time>/`` before it writes (``metrics.jsonl`` starts empty, the steps do not
repeat); a resumed run moves nothing and goes on appending; the launcher's files stay."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from rlfleet.common.config import load_config
from rlfleet.trainer import run_record
from rlfleet.trainer.run import run_training


def write(path, text: str = "x", mtime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def previous_run(run_dir) -> None:
    write(run_dir / "metrics.jsonl", json.dumps({"step": 1}) + "\n", mtime=1_700_000_000)
    write(run_dir / "summary.json", "{}", mtime=1_700_000_100)
    write(run_dir / "reward_curve.png")
    write(run_dir / "report.html")
    write(run_dir / "train_samples.jsonl")
    write(run_dir / "checkpoints" / "final" / "model.safetensors")
    write(run_dir / "endpoints.json", "{}")  # the launcher's, for the processes running now
    write(run_dir / "logs" / "router.log")
    write(run_dir / "config.trainer.yaml")


def test_the_previous_record_moves_aside_and_the_launchers_files_stay(tmp_path):
    previous_run(tmp_path)
    moved = run_record.set_aside_previous(tmp_path)
    assert moved.parent == tmp_path / "previous"
    assert moved.name == time.strftime("%Y%m%d-%H%M%S", time.localtime(1_700_000_100))
    assert sorted(p.name for p in moved.iterdir()) == sorted(
        [
            "metrics.jsonl",
            "summary.json",
            "reward_curve.png",
            "report.html",
            "train_samples.jsonl",
            "checkpoints",
        ]
    )
    assert (moved / "checkpoints" / "final" / "model.safetensors").is_file()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints").exists()
    for kept in ("endpoints.json", "logs/router.log", "config.trainer.yaml"):
        assert (tmp_path / kept).is_file()


def test_nothing_to_move_makes_no_previous_dir_and_two_in_a_second_do_not_collide(tmp_path):
    assert run_record.set_aside_previous(tmp_path) is None
    assert not (tmp_path / "previous").exists()
    write(tmp_path / "metrics.jsonl", mtime=1_700_000_000)
    first = run_record.set_aside_previous(tmp_path)
    write(tmp_path / "metrics.jsonl", mtime=1_700_000_000)
    second = run_record.set_aside_previous(tmp_path)
    assert second == first.with_name(first.name + "-2")
    assert (first / "metrics.jsonl").is_file() and (second / "metrics.jsonl").is_file()


class Stop(Exception):
    """Raised where the job would load the model: the record was settled before it."""


@pytest.fixture
def no_model(monkeypatch):
    def build_actor(config):
        raise Stop

    monkeypatch.setattr("rlfleet.trainer.run.build_actor", build_actor)


def test_a_fresh_run_starts_its_files_afresh(tmp_path, no_model):
    previous_run(tmp_path)
    config = load_config(None, [f"run_dir={tmp_path}"])
    with pytest.raises(Stop):
        asyncio.run(run_training(config))
    assert not (tmp_path / "metrics.jsonl").exists()
    [moved] = (tmp_path / "previous").iterdir()
    assert (moved / "metrics.jsonl").read_text() == json.dumps({"step": 1}) + "\n"


def test_a_resumed_run_keeps_appending(tmp_path, no_model):
    previous_run(tmp_path)
    write(tmp_path / "checkpoints" / "global_step_4" / "trainer_state.pt")  # a resume point
    config = load_config(None, [f"run_dir={tmp_path}", "trainer.resume_mode=auto"])
    with pytest.raises(Stop):
        asyncio.run(run_training(config))
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "previous").exists()


def test_resume_disabled_moves_the_old_checkpoints_too(tmp_path, no_model):
    """Else a later ``resume_mode=auto`` could pick up the previous run's steps."""
    previous_run(tmp_path)
    write(tmp_path / "checkpoints" / "global_step_4" / "trainer_state.pt")
    config = load_config(None, [f"run_dir={tmp_path}", "trainer.resume_mode=disable"])
    with pytest.raises(Stop):
        asyncio.run(run_training(config))
    [moved] = (tmp_path / "previous").iterdir()
    assert (moved / "checkpoints" / "global_step_4" / "trainer_state.pt").is_file()
    assert not (tmp_path / "checkpoints").exists()
