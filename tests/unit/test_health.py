"""The run-health rules on small hand-made metric rows: each fires on the signal it watches,
stays quiet on a healthy one and when its metric is absent; the monitor warns once per firing;
``assess`` replays a metrics file and judges the wait for the next step."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import yaml

from rlfleet.common.config import load_config
from rlfleet.common.config.health import HealthConfig
from rlfleet.dashboard.app import page_html
from rlfleet.dashboard.runfiles import HealthTail, health_findings
from rlfleet.dashboard.state import DashboardState
from rlfleet.status_cli import health_lines
from rlfleet.trainer.health import RULES, HealthMonitor, assess
from rlfleet.trainer.metrics import zero_variance_fraction

QUIET = {
    "actor/entropy": 0.5,
    "rollout_corr/kl": 0.01,
    "rollout_corr/chi2_token": 0.05,
    "batch/zero_variance_fraction": 0.4,
    "timing_s/step": 0.2,
    "perf/total_num_tokens": 1000.0,
}
"""A healthy step (the reward is added per step, wobbling as a batch mean does)."""


def step(i: int, **values: float) -> dict[str, float]:
    row = {**QUIET, "critic/score/mean": 0.3 + 0.05 * (i % 3), "training/global_step": i}
    return {**row, **{k.replace("__", "/"): v for k, v in values.items()}}


def fired(rows, **config) -> set[str]:
    return {f.rule for f in assess(rows, HealthConfig(**config))}


def healthy(count: int) -> list[dict]:
    return [step(i) for i in range(1, count + 1)]


def test_a_healthy_run_fires_nothing():
    assert fired(healthy(100)) == set()


def test_entropy_collapse_fires_below_a_fraction_of_its_first_value():
    falling = healthy(10) + [step(10 + i, actor__entropy=0.04) for i in range(1, 6)]
    assert fired(falling) == {"entropy_collapse"}
    assert fired(falling, entropy_min_fraction=0.05) == set()
    one_dip = healthy(10) + [step(11, actor__entropy=0.01)] + healthy(4)
    assert fired(one_dip) == set()  # the mean of the window


def test_mismatch_kl_and_chi2_fire_past_their_bounds():
    kl = healthy(10) + [step(10 + i, rollout_corr__kl=0.8) for i in range(1, 4)]
    assert fired(kl) == {"mismatch_kl"}
    chi2 = healthy(10) + [step(10 + i, rollout_corr__chi2_token=9.0) for i in range(1, 4)]
    assert fired(chi2) == {"mismatch_chi2"}
    two_spikes = healthy(10) + [step(11, rollout_corr__kl=5.0), step(12, rollout_corr__kl=5.0)]
    assert fired(two_spikes + healthy(3)) == set()  # the median of the window


def test_reward_flat_fires_when_the_batch_mean_stops_moving():
    dead = healthy(10) + [step(10 + i, critic__score__mean=0.0) for i in range(1, 21)]
    assert fired(dead) == {"reward_flat"}
    assert fired(dead[:-1]) == set()  # 19 flat steps < flat_steps
    assert fired(dead, flat_steps=0) == set()


def test_heldout_flat_fires_when_no_validation_beats_the_first():
    val = lambda acc: {"val-core/arith/reward/mean@1": acc}  # noqa: E731
    rows = healthy(10) + [val(0.3), *healthy(5), val(0.25), *healthy(5), val(0.3), val(0.2)]
    assert fired(rows) == {"heldout_flat"}
    assert fired(rows[:-1]) == set()  # three validations < flat_validations
    rows[-2] = val(0.35)
    assert fired(rows) == set()
    converged = healthy(10) + [val(0.3), val(0.8), val(0.8), val(0.8), val(0.8)]
    assert fired(converged) == set()  # holding its accuracy exactly is no fault
    two_sources = {"val-core/a/reward/mean@1": 0.2, "val-core/b/reward/mean@1": 0.4}
    assert fired([*healthy(10), val(0.3), two_sources, val(0.3), val(0.0)]) == {"heldout_flat"}


def test_zero_variance_fires_when_most_groups_have_no_spread():
    rows = healthy(10) + [step(10 + i, batch__zero_variance_fraction=1.0) for i in range(5)]
    assert fired(rows) == {"zero_variance"}
    assert fired(rows, max_zero_variance_fraction=0) == set()  # 0 turns it off
    dapo = {"dapo/dropped_groups": 60.0, "dapo/kept_groups": 2.0}
    assert fired(healthy(10) + [{**step(10 + i), **dapo} for i in range(5)]) == {"zero_variance"}


def test_zero_variance_fraction_counts_groups_of_two_or_more():
    scores = [1.0, 1.0, 0.0, 1.0, 0.5]
    assert zero_variance_fraction(scores, [0, 0, 1, 1, 2]) == {"batch/zero_variance_fraction": 0.5}
    assert zero_variance_fraction([1.0, 0.0], [0, 1]) == {}  # n = 1: nothing to judge


def test_stalled_names_the_slowest_phase_and_its_role():
    slow = step(31, timing_s__step=120.0, timing_s__reward=118.0, timing_s__gen=1.0)
    found = assess(healthy(30) + [slow], HealthConfig())
    assert [f.rule for f in found] == ["stalled"]
    assert "timing_s/reward 118.0 s: reward" in found[0].message
    assert fired(healthy(30) + [step(31, timing_s__step=30.0)]) == set()  # under stall_min_s


def test_stalled_from_the_wait_for_the_next_step():
    rows = healthy(30)
    assert [f.rule for f in assess(rows, HealthConfig(), waiting_s=300)] == ["stalled"]
    assert "no step for 300.0 s" in assess(rows, HealthConfig(), waiting_s=300)[0].message
    assert assess(rows, HealthConfig(), waiting_s=30) == []


def test_throughput_drop_fires_against_the_best_median():
    slower = [step(40 + i, timing_s__step=1.0) for i in range(1, 21)]  # 5x the step time
    assert fired(healthy(40) + slower) == {"throughput_drop"}
    assert fired(healthy(40) + slower[:9]) == set()  # still most of the window is fast


def test_a_rule_whose_metric_is_absent_stays_silent():
    bare = [{"training/global_step": float(i)} for i in range(1, 100)]
    assert fired(bare) == set()


def test_nothing_fires_during_the_warm_up():
    rows = [step(i, rollout_corr__kl=3.0) for i in range(1, 10)]
    assert fired(rows) == set()
    assert fired(rows, warmup_steps=5) == {"mismatch_kl"}


REJECTED = "rollout_corr__rollout_rs_masked_fraction"


def test_heavy_rejection_fires_from_the_first_window_not_after_the_warm_up():
    # verl's k3 bounds under async lag: 97% of the tokens rejected from the first step
    rows = [step(i, **{REJECTED: 0.97}) for i in range(1, 6)]
    assert fired(rows) == {"heavy_rejection"}  # step 5 < warmup_steps 10: still judged
    assert fired(rows[:4]) == set()  # fewer steps than the window: one noisy step is not it
    message = assess(rows, HealthConfig())[0].message
    assert "97%" in message and "rollout_correction" in message


def test_heavy_rejection_stays_quiet_at_or_below_its_bound_and_when_off():
    assert fired([step(i, **{REJECTED: 0.3}) for i in range(1, 30)]) == set()
    # one step of the window far over the bound: the window's mean is what counts
    mixed = [step(i, **{REJECTED: 0.7 if i == 20 else 0.2}) for i in range(1, 21)]
    assert fired(mixed) == set()  # mean of the last 5: (4 * 0.2 + 0.7) / 5 = 0.3
    heavy = [step(i, **{REJECTED: 0.8}) for i in range(1, 30)]
    assert fired(heavy, max_rejected_fraction=0) == set()
    assert fired(heavy, max_rejected_fraction=0.9) == set()


def test_the_monitor_warns_once_until_the_rule_clears(caplog):
    monitor = HealthMonitor(HealthConfig(warmup_steps=0, window=1))
    caplog.set_level(logging.INFO, logger="rlfleet.trainer.health")
    flags = [
        monitor.observe(step(i, rollout_corr__kl=kl))
        for i, kl in enumerate([0.9, 0.9, 0.01, 0.9], start=1)
    ]
    assert [f["health/mismatch_kl"] for f in flags] == [1.0, 1.0, 0.0, 1.0]
    assert set(flags[0]) == {"health/" + name for name in RULES}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "mismatch_kl: rollout_corr/kl 0.9" in warnings[0]
    assert any("mismatch_kl cleared" in r.getMessage() for r in caplog.records)


def test_the_monitor_is_off_when_disabled():
    monitor = HealthMonitor(HealthConfig(enabled=False))
    assert monitor.observe(step(1, rollout_corr__kl=9.0)) == {}
    assert assess(healthy(20), HealthConfig(enabled=False), waiting_s=1e6) == []


def test_replay_takes_in_a_resumed_runs_rows_silently(caplog):
    monitor = HealthMonitor(HealthConfig())
    monitor.replay(healthy(10) + [step(10 + i, rollout_corr__kl=2.0) for i in range(1, 4)])
    assert set(monitor.active) == {"mismatch_kl"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("field", ["window", "throughput_window"])
def test_windows_are_at_least_one(field):
    with pytest.raises(ValueError):
        HealthConfig(**{field: 0})


# ---- where the findings are read: the dashboard and ``rlfleet status`` ---------------------


def write_run(run_dir, rows, mtime_age_s: float = 0.0) -> None:
    path = run_dir / "metrics.jsonl"
    path.write_text(
        "".join(
            json.dumps({"step": int(r.get("training/global_step", 0)), **r}) + "\n" for r in rows
        )
    )
    os.utime(path, (time.time() - mtime_age_s, time.time() - mtime_age_s))


def test_the_dashboard_document_lists_the_findings(tmp_path):
    broken = healthy(10) + [step(10 + i, rollout_corr__kl=2.0) for i in range(1, 4)]
    write_run(tmp_path, broken)
    state = DashboardState(load_config(None, [f"run_dir={tmp_path}"], env={}))
    found = state.run_part()["health"]
    assert [f["rule"] for f in found] == ["mismatch_kl"] and "> 0.1" in found[0]["message"]
    page = page_html(1.0)
    assert 'id="health"' in page and "drawHealth(doc.health" in page


def test_a_run_waiting_too_long_for_its_next_step_is_stalled_until_it_finishes(tmp_path):
    write_run(tmp_path, healthy(30), mtime_age_s=600)
    config = HealthConfig()
    assert [f["rule"] for f in health_findings(tmp_path, healthy(30), config)] == ["stalled"]
    (tmp_path / "summary.json").write_text("{}")
    assert health_findings(tmp_path, healthy(30), config) == []


def test_status_lists_the_findings_with_the_thresholds_the_trainer_recorded(tmp_path):
    write_run(tmp_path, healthy(10) + [step(10 + i, rollout_corr__kl=0.8) for i in range(1, 4)])
    config = load_config(None, [f"run_dir={tmp_path}"], env={})
    lines = health_lines(config)
    assert lines[0].startswith("health: 1 warning(s) (step 13)")
    assert lines[1].startswith("  WARNING mismatch_kl: rollout_corr/kl 0.8")
    recorded = {"trainer": {"health": {"max_mismatch_kl": 1.0}}}
    (tmp_path / "config.trainer.yaml").write_text(yaml.safe_dump(recorded))
    assert health_lines(config) == ["health: ok (step 13, no rule fires)"]
    assert health_lines(load_config(None, [f"run_dir={tmp_path}/none"], env={}))[0].startswith(
        "health: no metrics in"
    )


def test_the_dashboard_feeds_the_rules_only_new_rows_and_starts_over_on_a_new_run(tmp_path):
    tail = HealthTail(HealthConfig())
    rows = healthy(10)
    assert tail.findings(tmp_path, rows) == []
    rows += [step(10 + i, rollout_corr__kl=2.0) for i in range(1, 4)]  # the same list grows
    assert [f["rule"] for f in tail.findings(tmp_path, rows)] == ["mismatch_kl"]
    assert tail._monitor.trace.steps == 13  # each row fed once
    assert tail.findings(tmp_path, healthy(12)) == []  # a new list: a new run
