"""bench_real_model's ``learn`` section, its arithmetic on recorded runs: the fleet side read
from a finished run directory, the rows and the issue's targets, and the plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
real_model_learn = pytest.importorskip("real_model_learn")
real_model_fleet = pytest.importorskip("real_model_fleet")

KEY = real_model_learn.ACCURACY_KEY


def fleet_run_dir(tmp_path: Path) -> Path:
    """A finished run: validation before (0.2), at step 2 (0.3) and after step 3 (0.5)."""
    steps = [
        {
            "step": i,
            "timing_s/step": 10.0 + i,
            "timing_s/gen": 4.0,
            "timing_s/reward": 0.1,
            "timing_s/update_actor": 5.0,
            "timing_s/push_weights": 0.5,
            "critic/score/mean": 0.1 * i,
        }
        for i in (1, 2, 3)
    ]
    rows = [steps[0], steps[1], {"step": 2, KEY: 0.3, "training/time_s": 23.0}, steps[2]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"training_time_s": 36.0, "val_before": {KEY: 0.2}, "val_after": {KEY: 0.5}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_a_finished_run_gives_the_fleet_record_and_its_curve(tmp_path):
    run = real_model_fleet.GrpoFleetRun("async", 10, 8, 0.0, [], real_model_learn.CONFIG, KEY)
    record = real_model_fleet.finished_run(run, fleet_run_dir(tmp_path))
    assert (record["val_before"], record["val_after"], record["steps_done"]) == (0.2, 0.5, 3)
    assert record["curve"] == [[0, 0.0, 0.2], [2, 23.0, 0.3], [3, 36.0, 0.5]]
    assert record["from_run_dir"] == str(tmp_path) and "error" not in record


def test_rows_and_targets_from_both_sides(tmp_path):
    run = real_model_fleet.GrpoFleetRun("async", 10, 8, 0.0, [], real_model_learn.CONFIG, KEY)
    fleet = real_model_fleet.finished_run(run, fleet_run_dir(tmp_path))
    trl = {
        "steps": [
            {"step_s": 40.0, "gen": 30.0, "reward": 0.1, "update": 9.0},
            {"step_s": 44.0, "gen": 33.0, "reward": 0.1, "update": 10.0},
        ],
        "training_time_s": 84.0,
        "val_before": 0.2,
        "val_after": 0.3,
        "peak_rss_GB": 5.0,
    }
    rows = [*real_model_learn.rows_of("fleet", fleet), *real_model_learn.rows_of("trl", trl)]
    main = {r["variant"]: r for r in rows if "val_before" in r}
    assert main["fleet"]["gain"] == pytest.approx(0.3) and main["trl"]["gain"] == pytest.approx(0.1)
    assert main["fleet"]["s_per_step"] == 12.5  # the median of the steps after the first
    ratios = real_model_learn.ratios_of(rows)
    assert ratios["fleet held-out gain (target >= 0.25)"] == 0.3
    assert ratios["fleet gain - TRL gain (target >= 0.10)"] == 0.2
    assert ratios["fleet / TRL s/step (target <= 0.3)"] == pytest.approx(12.5 / 44.0, abs=1e-3)
    assert ratios["largest peak RSS of one process GB (target <= 4)"] == 5.0


def test_the_plot_is_drawn_from_the_curves(tmp_path):
    records = {
        "fleet": {"curve": [[0, 0.0, 0.2], [3, 36.0, 0.5]]},
        "trl": {"curve": [[0, 0.0, 0.2], [2, 84.0, 0.3]]},
    }
    path = real_model_learn.plot_curves(records, tmp_path / "learning.png")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"
    assert real_model_learn.plot_curves({"fleet": {}}, tmp_path / "none.png") is None


def test_warm_up_steps_get_their_own_row_and_the_peaks_come_from_the_run(tmp_path):
    """SFT steps (metrics ``sft/*``) stay out of the GRPO s/step; ``rlfleet up``'s
    ``peak_rss.json`` gives the fleet's peak RSS per role."""
    run_dir = fleet_run_dir(tmp_path)
    sft = [{"step": 0, "timing_s/step": 3.0, "sft/trained_tokens": 100.0}] * 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft + rows))
    peaks = {"peak_rss_GiB": {"trainer": 3.5, "rollout-0": 2.9}}
    (run_dir / "peak_rss.json").write_text(json.dumps(peaks))
    run = real_model_fleet.GrpoFleetRun("async", 10, 8, 0.0, [], real_model_learn.CONFIG, KEY)

    fleet_rows = real_model_learn.rows_of("fleet", real_model_fleet.finished_run(run, run_dir))

    main, *rest = fleet_rows
    assert main["s_per_step"] == 12.5 and main["steps"] == 6  # GRPO steps 2-3; all 6 counted
    assert main["peak_rss_GB"] == 3.5
    warm_up = next(r for r in rest if r["kind"] == "SFT warm-up step")
    assert (warm_up["n"], warm_up["s_per_step"]) == (3, 3.0)
    assert {r["kind"]: r["peak_rss_GB"] for r in rest if "peak" in r["kind"]} == {
        "trainer peak RSS": 3.5,
        "rollout-0 peak RSS": 2.9,
    }
