"""The run-health rules that test_health_runs.py does not break live, each on a run of the
default job broken on purpose (``default_job_inprocess``: ``configs/default.yaml`` with its
services in-process, the transformers engine, the arithmetic scorer):

- ``entropy_collapse``: an entropy term that rewards certainty (``entropy_coeff`` -10, where a
  bonus is positive) at a learning rate 10x the recipe's drives the policy's entropy from
  ~0.5 to ~0.001 within five steps;
- ``mismatch_chi2``: the learning rate 10x too high alone moves the policy so far within a
  step that the engine's samples get importance ratios of chi2 8-150;
- ``stalled``: the replica stops answering once, for 25x its usual time between batches;
- ``throughput_drop``: the replica slows down for good, by 6x its usual time between batches.

The two timing rules run with their floors lowered (``stall_min_s`` 2 s instead of 60,
``throughput_window`` 4 steps instead of 20): the floors keep a long run's noise out, and a
test cannot wait a minute for a stall. The slowdowns are measured against the replica's own
pace (``Hold``), so they stand out on a fast machine and on a loaded one alike. The shipped
recipe staying quiet with every default is test_health_runs.py's (30 steps live, all 1,200 of
one run replayed).
"""

from __future__ import annotations

import pytest
from default_job_inprocess import TINY_MODEL, Hold, default_job, judged_run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TINY_MODEL.exists(), reason="tiny model not built"),
]

LR_X10 = "trainer.lr=1.5e-3"  # the recipe's 1.5e-4, x10


def test_an_entropy_term_that_rewards_certainty_collapses_the_entropy(caplog, tmp_path):
    config = default_job(tmp_path, 12, "trainer.entropy_coeff=-10", LR_X10, "trainer.test_freq=0")
    flagged, warned = judged_run(caplog, config)
    assert "entropy_collapse" in flagged
    line = next(w for w in warned if w.startswith("run health: entropy_collapse: "))
    assert "fell below 0.1 x its first value" in line


def test_a_learning_rate_10x_too_high_fires_mismatch_chi2(caplog, tmp_path):
    flagged, warned = judged_run(caplog, default_job(tmp_path, 12, LR_X10, "trainer.test_freq=0"))
    assert "mismatch_chi2" in flagged
    assert any(w.startswith("run health: mismatch_chi2: rollout_corr/chi2_token ") for w in warned)


def timing_job(tmp_path, steps: int, *overrides: str):
    return default_job(
        tmp_path, steps, "trainer.test_freq=0", "trainer.health.stall_min_s=2", *overrides
    )


def test_a_replica_that_stops_answering_once_fires_stalled(caplog, tmp_path):
    hold = Hold(first=12, last=12, factor=25, min_s=3)
    flagged, warned = judged_run(caplog, timing_job(tmp_path, 12), hold=hold)
    assert "stalled" in flagged
    line = next(w for w in warned if w.startswith("run health: stalled: "))
    assert "x the median step" in line and "slowest phase timing_s/" in line
    assert ": rollout (" in line  # the wait was on generation, and the line says so


def test_a_replica_that_slows_down_for_good_fires_throughput_drop(caplog, tmp_path):
    hold = Hold(first=12, last=10**9, factor=6)
    config = timing_job(tmp_path, 16, "trainer.health.throughput_window=4")
    flagged, warned = judged_run(caplog, config, hold=hold)
    assert "throughput_drop" in flagged
    assert any(w.startswith("run health: throughput_drop: ") for w in warned)
