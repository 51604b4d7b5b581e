"""A resumed run's bookkeeping (issue 19): the rows ``metrics.jsonl`` gets after a resume are
marked (``segment``, and ``retrained`` for steps logged before), the rows that stand are one
per step, and the run's clock (training time, accuracy before the first step, time to target)
goes into the checkpoint and comes back from it."""

from __future__ import annotations

import json
import time

from rlfleet.common.config import load_config
from rlfleet.trainer.clock import TrainingClock
from rlfleet.trainer.loggers import Tracker
from rlfleet.trainer.metrics import MetricsWriter, read_rows, standing_rows
from rlfleet.trainer.run import finished


def write_steps(writer: MetricsWriter, steps) -> None:
    for step in steps:
        writer.write(step, {"critic/score/mean": step / 10, "training/global_step": step})


def test_a_fresh_run_writes_unmarked_rows(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    write_steps(writer, [1, 2])
    assert [set(r) for r in read_rows(writer.path)] == [
        {"step", "critic/score/mean", "training/global_step"}
    ] * 2


def test_rows_after_a_resume_are_marked_and_supersede_the_dead_segments(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_steps(MetricsWriter(path), [1, 2, 3, 4])  # killed after step 4, checkpoint at 2
    path.write_text(path.read_text() + '{"step": 5, "critic/sc')  # a torn last line
    second = MetricsWriter(path)
    assert [r["step"] for r in second.resume(2)] == [1, 2]  # what stands of segment 0
    write_steps(second, [3, 4, 5])
    rows = read_rows(path)
    assert [(r["step"], r.get("segment"), r.get("retrained")) for r in rows] == [
        (1, None, None),
        (2, None, None),
        (3, None, None),
        (4, None, None),
        (3, 1, True),
        (4, 1, True),
        (5, 1, None),
    ]
    third = MetricsWriter(path)  # killed again after step 5; resumed from step 4
    assert [(r["step"], r.get("segment")) for r in third.resume(4)] == [
        (1, None),
        (2, None),
        (3, 1),
        (4, 1),
    ]
    write_steps(third, [5, 6])
    standing = standing_rows(read_rows(path))
    assert [(r["step"], r.get("segment", 0)) for r in standing] == [
        (1, 0),
        (2, 0),
        (3, 1),
        (4, 1),
        (5, 2),
        (6, 2),
    ]
    assert [r.get("retrained") for r in read_rows(path)[-2:]] == [True, None]


def test_tracker_history_starts_with_the_standing_rows(tmp_path):
    config = load_config(None, [f"run_dir={tmp_path}", "trainer.logger=[jsonl]"])
    first = Tracker.from_config(config)
    for step in (1, 2, 3):
        first.log(step, {"critic/score/mean": 0.5})
    resumed = Tracker.from_config(config)
    resumed.resume(2)
    assert resumed.segment == 1
    assert [r["step"] for r in resumed.history] == [1, 2]
    resumed.log(3, {"critic/score/mean": 0.7})
    assert [r["step"] for r in resumed.history] == [1, 2, 3]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 3, "segment": 1, "retrained": True, "critic/score/mean": 0.7}


def test_the_clock_goes_on_across_segments():
    clock = TrainingClock(0.5)
    clock.val_before = {"val/acc": 0.2}
    clock.begin()
    time.sleep(0.05)
    clock.observe(0.6)  # reached after 0 s of paused time: time_to_target_s = training_s
    state = clock.state()  # mid-loop, as a step checkpoint takes it: the running stretch too
    assert state["training_s"] >= 0.05 and state["val_before"] == {"val/acc": 0.2}
    resumed = TrainingClock(0.5)
    resumed.restore(json.loads(json.dumps(state)))  # it survives being saved
    assert resumed.restored and resumed.val_before == {"val/acc": 0.2}
    assert resumed.training_s == state["training_s"] and resumed.time_to_target_s == 0.0
    resumed.begin()
    time.sleep(0.02)
    resumed.pause()
    assert resumed.training_s >= state["training_s"] + 0.02


def test_a_training_time_budget_ends_the_run_at_a_step_boundary():
    """``trainer.max_training_s``: the run stops after the step in which the clock passed the
    budget; 0 means steps alone decide; ``total_steps`` still ends a run within its budget."""
    config = load_config(None, ["trainer.total_steps=10", "trainer.max_training_s=100"]).trainer
    clock = TrainingClock(1.0)
    clock.restore({"training_s": 99.0})
    assert not finished(config, 3, clock)
    clock.restore({"training_s": 100.5})
    assert finished(config, 3, clock)
    assert finished(config.model_copy(update={"max_training_s": 1e9}), 10, clock)
    assert not finished(config.model_copy(update={"max_training_s": 0.0}), 9, clock)
