"""Run health on a live fleet: ``rlfleet up`` (embedded Redis, router, one HF replica, reward,
trainer, dashboard) trains the default job with a learning rate 100x too high, the policy
collapses to one answer, and while the run still goes:

- the trainer's log carries the rule's WARNING line and ``metrics.jsonl`` its flag;
- ``rlfleet status --run-dir`` (a separate process, probing the live fleet) lists it;
- the dashboard's ``GET /api/state`` carries it in ``health``, which the page draws as its
  banner (``drawHealth(doc.health)``).

The rule is ``zero_variance``: a collapsed policy gives every sample of a group the same
score (tests/unit/test_health_runs.py fires it in-process on the same setting).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from procs import ROOT, ServiceProcess
from up_proc import up_argv

pytestmark = pytest.mark.slow

BROKEN = [
    "trainer.lr=1.5e-2",  # the default job's 1.5e-4, x100
    "trainer.test_freq=0",
    "dashboard.enabled=true",
    "dashboard.refresh_s=0.5",
]


def flagged_step(run_dir: Path, rule: str) -> int | None:
    """The first step whose metrics row flags ``rule`` (None: none yet)."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        row = json.loads(line) if line.endswith("}") else {}
        if row.get(f"health/{rule}"):
            return int(row["step"])
    return None


def dashboard_state(run_dir: Path) -> dict:
    url = json.loads((run_dir / "endpoints.json").read_text())["dashboard"]["http"]
    with urllib.request.urlopen(url + "api/state", timeout=10) as reply:
        return json.loads(reply.read())


def status(run_dir: Path) -> str:
    argv = [sys.executable, "-m", "rlfleet.cli", "status", "--run-dir", str(run_dir)]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_broken_run_is_flagged_by_status_and_the_dashboard_while_it_trains(tmp_path):
    run_dir = tmp_path / "run"
    argv = up_argv(run_dir, "hf", 100_000, BROKEN, replicas=1)
    up = ServiceProcess.start(argv, tmp_path / "up.log", name="rlfleet up")
    try:
        up.wait_until(lambda: flagged_step(run_dir, "zero_variance"), 480, "zero_variance")
        out = status(run_dir)
        doc = dashboard_state(run_dir)
        assert up.poll() is None, up.log_tail()  # all of it against the running fleet
    finally:
        up.stop(signal.SIGTERM)
    assert "replicas (1, from router " in out, out  # it probed the live fleet
    assert "WARNING zero_variance: " in out and "of the groups scored all alike" in out, out
    assert "health: " in out and " warning(s) (step " in out, out
    rules = [finding["rule"] for finding in doc["health"]]
    assert "zero_variance" in rules, doc["health"]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "run health: zero_variance: " in trainer_log
