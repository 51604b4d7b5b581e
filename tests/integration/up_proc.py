"""Run a short training job through the whole fleet, started the way users start it.

``run_up`` runs ``python -m rlfleet.cli up`` (embedded Redis, router, two rollout replicas unless
told otherwise, reward, refcritic when the config needs it, trainer) to the end, on the default
config with a small batch, and ``read_metrics`` reads the ``metrics.jsonl`` it left in its run
directory. Shared by the end-to-end tests (``test_fleet_e2e``, ``test_lora_fleet``);
``replica_pid`` finds a fleet's replica process to kill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from procs import ROOT


def run_up(
    run_dir: Path,
    backend: str,
    steps: int = 3,
    extra: list[str] | None = None,
    config: str = "default.yaml",
    replicas: int = 2,
) -> subprocess.CompletedProcess:
    """``rlfleet up`` to its end; ``replicas`` rollout replicas (the agent tests run one: a
    second replica costs a model load and its share of the two CI cores)."""
    argv = up_argv(run_dir, backend, steps, extra, config, replicas)
    env = {k: v for k, v in os.environ.items() if k != "RLFLEET_REDIS_URL"}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def up_argv(
    run_dir: Path,
    backend: str,
    steps: int,
    extra: list[str] | None,
    config: str = "default.yaml",
    replicas: int = 2,
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "up",
        "--config",
        str(ROOT / "configs" / config),
        "--rollout-replicas",
        str(replicas),
        f"run_dir={run_dir}",
        f"cluster=e2e{backend}",
        f"rollout.backend={backend}",
        f"trainer.total_steps={steps}",
        "data.val_size=16",
        "data.train_batch_size=4",
        "trainer.replica_wait_s=240",
        "dashboard.enabled=false",  # one process less per fleet; the dashboard test turns it on
        *(extra or []),
    ]


def replica_pid(run_dir: Path, replica_id: str) -> int:
    """The PID of this run's replica process (its argv names the run dir and the id)."""
    found = subprocess.run(
        ["pgrep", "-f", f"run_dir={run_dir} .*rollout.replica_id={replica_id}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(found) == 1, f"expected one {replica_id} process, found {found}"
    return int(found[0])


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


ERROR_WORDS = ("Error", "error:", "Exception", "failed", "Killed", "Traceback")


def failure_report(result: subprocess.CompletedProcess, run_dir: Path, lines: int = 40) -> str:
    """What a failed ``rlfleet up`` said, and the error lines of every role's log: the root cause
    (a vLLM worker's traceback, say) sits far above the tail of the launcher's output."""
    parts = [result.stdout[-3000:], result.stderr[-2000:]]
    for log in sorted((run_dir / "logs").glob("*.log")):
        text = log.read_text(errors="replace").splitlines()
        hits = [line for line in text if any(word in line for word in ERROR_WORDS)]
        if hits:
            parts.append(f"--- {log.name}: {len(hits)} error lines, the last {lines}:")
            parts.extend(hits[-lines:])
    return "\n".join(parts)
