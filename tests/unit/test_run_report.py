"""The pictures at the end of a run, from a small ``metrics.jsonl``: the series
``reward_curve.png`` plots (sampled reward, held-out accuracy at each validation, the target),
the PNG itself, and ``report.html`` (the same curves as inline SVG, the step time by phase, the
final numbers; nothing fetched from outside)."""

from __future__ import annotations

import json

import pytest

from rlfleet.trainer import report
from rlfleet.trainer.metrics import read_rows

VAL = "val-core/arith/reward/mean@1"


def step_row(step: int, score: float) -> dict:
    return {
        "step": step,
        "training/global_step": float(step),
        "critic/score/mean": score,
        "actor/entropy": 0.6,
        "response_length/mean": 4.0,
        "timing_s/step": 1.0,
        "timing_s/gen": 0.5,
        "timing_s/reward": 0.1,
        "timing_s/ref": 0.05,
        "timing_s/old_log_prob": 0.05,
        "timing_s/update_actor": 0.2,
        "timing_s/push_weights": 0.1,
    }


@pytest.fixture
def history(tmp_path) -> list[dict]:
    """Six steps, a validation after steps 3 and 6 (as the trainer writes them)."""
    path = tmp_path / "metrics.jsonl"
    rows = [step_row(s, 0.1 * s) for s in range(1, 4)]
    rows.append({"step": 3, VAL: 0.5, "training/time_s": 3.0})
    rows += [step_row(s, 0.1 * s) for s in range(4, 7)]
    rows.append({"step": 6, VAL: 0.7, "training/time_s": 6.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_rows(path)


SUMMARY = {
    "steps": 6,
    "wall_time_s": 12.3,
    "training_time_s": 6.0,
    "target_accuracy": 0.85,
    "time_to_target_s": None,
    "val_before": {VAL: 0.25},
    "val_after": {VAL: 0.875},
}


def test_series_hold_the_reward_and_the_held_out_accuracy_at_every_validation(history):
    series = report.curve_series(history, {VAL: 0.25}, {VAL: 0.875}, final_step=6, target=0.85)
    assert series.steps == [1, 2, 3, 4, 5, 6]
    assert series.scores == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert len(series.smooth) == 6
    # before (step 0), the two validation rows, after (the final validation at step 6 is the
    # run's last word on step 6: it replaces the row's, the same weights validated again)
    assert series.val == {"arith/reward/mean@1": [(0, 0.25), (3, 0.5), (6, 0.875)]}
    assert series.target == 0.85


def test_series_without_validation_have_no_held_out_curve(history):
    rows = [r for r in history if VAL not in r]
    series = report.curve_series(rows, {}, {}, final_step=6, target=None)
    assert series.val == {} and series.target is None and len(series.steps) == 6


def test_reward_curve_png_is_written(history, tmp_path):
    pytest.importorskip("matplotlib")
    series = report.curve_series(history, {VAL: 0.25}, {VAL: 0.875}, 6, 0.85)
    path = report.plot_reward_curve(series, tmp_path / "reward_curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000


def test_phase_means_group_the_timings_by_phase(history):
    means = report.phase_means(history)
    assert means["generate"] == pytest.approx(0.5)
    assert means["reference"] == pytest.approx(0.1)  # ref + old log-probs
    assert means["update"] == pytest.approx(0.2)
    assert means["push"] == pytest.approx(0.1) and means["idle"] == 0.0


def test_report_html_holds_the_curves_the_phases_and_the_numbers(history, tmp_path):
    series = report.curve_series(history, {VAL: 0.25}, {VAL: 0.875}, 6, 0.85)
    path = report.write_report(
        series, history, {"run_dir": "runs/x", **SUMMARY}, tmp_path / "report.html"
    )
    text = path.read_text()
    assert text.startswith("<!doctype html>")
    assert f"held-out {VAL}: 0.250 &rarr; 0.875" in text  # the final numbers
    assert "time to 0.85: never" in text and "12.3" in text
    assert "target 0.85" in text  # the target line on the reward chart
    assert text.count("<svg") >= 5  # reward, KL-less small charts (3), the phase bar
    for phase in ("generate", "reward", "reference", "update", "push", "idle"):
        assert f"{phase}</td>" in text
    assert "0.500 s" in text  # generate's mean
    assert "http://" not in text and "https://" not in text and "<script" not in text
    assert "<img" not in text  # no outside picture either: the curves are inline


def test_report_escapes_what_it_shows(history, tmp_path):
    series = report.curve_series(history, None, None, None, None)
    text = report.report_html(series, history, {"run_dir": "<b>x</b>", "steps": 6})
    assert "<b>x</b>" not in text and "&lt;b&gt;x&lt;/b&gt;" in text
