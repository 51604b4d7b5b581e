"""The run-health defaults on real runs of the default job: quiet on the shipped recipe, firing
on deliberately broken runs (a learning rate 100x too high; a replica that serves stale
weights).

The job is ``configs/default.yaml`` itself (GRPO, async with staleness 1, the shipped tiny
model, the arithmetic data) with its services in-process (``default_job_inprocess``): the
transformers engine (``HFEngine``) generates, takes each push (or, as the stale replica,
ignores it and reports the version anyway), and the arithmetic scorer scores. The other rules'
broken runs: test_health_broken_runs.py. A short prefix of the job runs here
(seconds); ``test_the_whole_default_job_stays_quiet`` replays the metrics of all 1,200 steps
of one such run, kept in ``tests/data/health/`` (``python tests/unit/test_health_runs.py``
trains it again and rewrites the file: about 10 minutes on 2 cores).
"""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest
from default_job_inprocess import ROOT, TINY_MODEL, default_job, judged_run, train

from rlfleet.common.config import load_config
from rlfleet.trainer.health import PHASE_ROLES, HealthMonitor, assess

WHOLE_RUN = ROOT / "tests" / "data" / "health" / "default_job_metrics.jsonl.gz"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TINY_MODEL.exists(), reason="tiny model not built"),
]


def run(caplog, tmp_path, steps: int, *overrides: str, stale: bool = False):
    return judged_run(caplog, default_job(tmp_path, steps, *overrides), stale=stale)


def test_the_default_job_stays_quiet(caplog, tmp_path):
    flagged, warned = run(caplog, tmp_path, 30, "trainer.test_freq=10")
    assert flagged == set() and warned == []


def test_a_learning_rate_100x_too_high_fires(caplog, tmp_path):
    flagged, warned = run(caplog, tmp_path, 25, "trainer.lr=1.5e-2", "trainer.test_freq=5")
    assert {"zero_variance", "reward_flat", "heldout_flat", "mismatch_kl"} <= flagged
    assert any(line.startswith("run health: zero_variance: 100% of the groups") for line in warned)
    assert len(warned) == len(set(warned))  # once per rule until it clears


def test_a_replica_serving_stale_weights_fires(caplog, tmp_path):
    flagged, warned = run(caplog, tmp_path, 15, "trainer.test_freq=0", stale=True)
    assert "mismatch_kl" in flagged
    assert any("mismatch_kl: rollout_corr/kl" in line for line in warned)


def test_the_whole_default_job_stays_quiet():
    """All 1,200 steps of the default job (this file's harness, validation every 50 steps on
    its 500 held-out prompts), reduced to the metrics the rules read: no rule fires at any
    step, with every default on (the timing rules included)."""
    with gzip.open(WHOLE_RUN, "rt") as handle:
        rows = [json.loads(line) for line in handle]
    assert sum("training/global_step" in r for r in rows) == 1200
    config = load_config(str(ROOT / "configs" / "default.yaml"), [], env={})
    monitor = HealthMonitor(config.trainer.health)
    fired = {(k, row["step"]) for row in rows for k, v in monitor.observe(row).items() if v}
    assert fired == set()
    assert assess(rows, config.trainer.health, waiting_s=0.0) == []


KEPT = (
    "step",
    "training/global_step",
    "critic/score/mean",
    "actor/entropy",
    "rollout_corr/kl",
    "rollout_corr/chi2_token",
    "batch/zero_variance_fraction",
    "perf/total_num_tokens",
    "timing_s/step",
    *PHASE_ROLES,
)
"""What the rules read of a training row (validation rows keep their ``val-core/*``)."""


def write_whole_run(path: Path = WHOLE_RUN) -> None:
    """Train the whole default job here and keep what the rules read, rounded."""
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        rows = asyncio.run(
            train(
                default_job(
                    Path(run_dir), 1200, "trainer.health.enabled=false", "data.val_size=500"
                ),
                stale=False,
            )
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as handle:
        for row in rows:
            kept = {
                k: float(f"{v:.5g}")
                for k, v in row.items()
                if k in KEPT or k.startswith("val-core/")
            }
            handle.write(json.dumps(kept) + "\n")


if __name__ == "__main__":
    write_whole_run()
