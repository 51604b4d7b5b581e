"""One run of the real fleet (``rlfleet up``) for bench_e2e.py, watched from outside.

Why a subprocess: the benchmark must time what a user runs, every service in its own process,
talking over real gRPC and Redis. The run gets its own embedded Redis (started here, so its URL
is known and its counters hold this run only), writes ``metrics.jsonl`` as it goes, and is
stopped with SIGINT (``rlfleet up``'s own clean shutdown) once the held-out target is reached
or the training-time budget is spent; SIGKILL to its process group only if that hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
import e2e_probe

CONFIG = common.REPO / "configs" / "default.yaml"
ACCURACY_KEY = "val-core/arith/reward/mean@1"
POLL_S = 0.5
STOP_WAIT_S = 60.0


@dataclass
class FleetRun:
    """One ``rlfleet up`` job. ``steps`` sets ``trainer.total_steps`` (and so the lr schedule)."""

    mode: str
    batch: int
    steps: int
    seed: int = 0
    test_freq: int = 0
    budget_s: float = 0.0
    target: float = 0.85
    warmup: int = 3
    overrides: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        kind = "ttt" if self.test_freq else "speed"
        return f"fleet-{self.mode}-{self.batch}x-{kind}-s{self.seed}"

    def argv(self, run_dir: Path, redis_url: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "up",
            "--config",
            str(CONFIG),
            f"run_dir={run_dir}",
            f"redis_url={redis_url}",
            f"trainer.mode={self.mode}",
            f"trainer.total_steps={self.steps}",
            f"data.train_batch_size={self.batch}",
            f"trainer.seed={self.seed}",
            f"data.seed={self.seed}",
            f"trainer.test_freq={self.test_freq}",
            f"trainer.target_accuracy={self.target}",
            f"trainer.val_before_train={str(bool(self.test_freq)).lower()}",
            "trainer.save_freq=0",
            *self.overrides,
        ]


class MetricsTail:
    """Reads ``metrics.jsonl`` incrementally while the trainer appends to it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict] = []
        self._offset = 0

    def poll(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open(encoding="utf-8") as handle:
            handle.seek(self._offset)
            text = handle.read()
        complete = text[: text.rfind("\n") + 1]
        self._offset += len(complete.encode())
        self.rows += [json.loads(line) for line in complete.splitlines() if line.strip()]

    @property
    def step(self) -> int:
        return max((int(r["step"]) for r in self.rows if "timing_s/step" in r), default=0)

    def training_s(self) -> float:
        """The step clock (validation excluded), as the trainer's own TrainingClock counts it."""
        return sum(r["timing_s/step"] for r in self.rows if "timing_s/step" in r)

    def evals(self) -> list[list[float]]:
        """[step, training seconds, held-out accuracy] for every periodic validation."""
        return [
            [r["step"], r.get("training/time_s", 0.0), r[ACCURACY_KEY]]
            for r in self.rows
            if ACCURACY_KEY in r
        ]


def run_fleet(run: FleetRun, work_dir: Path, timeout_s: float) -> dict:
    """Run the job to its end (or target, budget, timeout); everything measured about it."""
    from rlfleet.common.redis_server import EmbeddedRedis

    run_dir = work_dir / run.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    load_before = common.load_avg()
    with EmbeddedRedis(run_dir / "redis-bench") as redis_server:
        record = _watch(run, run_dir, redis_server, timeout_s)
    record["load_avg"] = {"before": load_before, "after": common.load_avg()}
    return record


def _watch(run: FleetRun, run_dir: Path, redis_server, timeout_s: float) -> dict:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    log = (run_dir / "up.log").open("wb")
    proc = subprocess.Popen(
        run.argv(run_dir, redis_server.url),
        cwd=common.REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tree = e2e_probe.ProcessTree(proc.pid, {redis_server._proc.pid: "redis"})
    tail = MetricsTail(run_dir / "metrics.jsonl")
    try:
        snaps, reason = _follow(run, proc, tree, client, tail, timeout_s)
    finally:
        _stop(proc)
        log.close()
        client.close()
    tail.poll()
    return _record(run, run_dir, proc.returncode, tree.sample(), snaps, reason, tail)


def _follow(run, proc, tree, client, tail: MetricsTail, timeout_s: float):
    """Poll until the job ends or should be stopped; snapshots after warm-up and at the end."""
    deadline = time.monotonic() + timeout_s
    snaps: list[e2e_probe.Snapshot] = []
    while proc.poll() is None:
        time.sleep(POLL_S)
        tail.poll()
        tree.sample()
        if len(snaps) == 0 and tail.step >= run.warmup:
            snaps.append(e2e_probe.snapshot(tree, client, tail.step))
        if len(snaps) == 1 and tail.step >= max(run.steps - 1, run.warmup + 1):
            snaps.append(e2e_probe.snapshot(tree, client, tail.step))
        reason = _stop_reason(run, tail, deadline)
        if reason:
            if len(snaps) == 1 and tail.step > snaps[0].step:
                snaps.append(e2e_probe.snapshot(tree, client, tail.step))
            return snaps, reason
    return snaps, "finished"


def _stop_reason(run: FleetRun, tail: MetricsTail, deadline: float) -> str | None:
    if any(acc >= run.target for _, _, acc in tail.evals()):
        return "target reached"
    if run.budget_s and tail.training_s() >= run.budget_s:
        return "budget spent"
    if time.monotonic() > deadline:
        return "timeout"
    return None


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (``rlfleet up`` stops every role it started) and wait for it; only if it hangs,
    SIGTERM and then SIGKILL. Then no role it started may be left: a router, replica or
    reward still running (each in its own session) would skew the next run's measurements."""
    import psutil

    try:
        roles = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        roles = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        for sig, wait_s in ((None, STOP_WAIT_S), (signal.SIGTERM, 15.0), (signal.SIGKILL, None)):
            if sig is not None:
                common.progress(f"rlfleet up (pid {proc.pid}) did not stop: {sig.name} to it")
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
    _stop_leftovers(roles)


def _stop_leftovers(processes: list) -> None:
    """SIGTERM whatever of ``processes`` still runs, SIGKILL it 15 s later."""
    import psutil

    alive = [p for p in processes if p.is_running()]
    if not alive:
        return
    common.progress(f"left running after rlfleet up: {[p.pid for p in alive]}; SIGTERM")
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(alive, timeout=15.0)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _record(run: FleetRun, run_dir: Path, code, cpu_total, snaps, reason, tail) -> dict:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    steps = [r for r in tail.rows if "timing_s/step" in r]
    record = {
        "run": run.name,
        "mode": run.mode,
        "batch": run.batch,
        "seed": run.seed,
        "exit_code": code,
        "stopped_by": reason,
        "steps_done": tail.step,
        "summary": summary,
        "cpu_s_total": cpu_total,
        "evals": tail.evals(),
        "training_time_s": summary.get("training_time_s", tail.training_s()),
        "phases_median": phase_medians(steps[run.warmup :]),
        "reward": [[r["step"], r["critic/score/mean"]] for r in steps if "critic/score/mean" in r],
    }
    before = summary.get("val_before") or logged_before(run_dir / "up.log")
    if ACCURACY_KEY in before:
        record["evals"].insert(0, [0, 0.0, before[ACCURACY_KEY]])
    record["time_to_target_s"] = time_to_target(record["evals"], run.target, summary)
    if len(snaps) == 2:
        record["window"] = e2e_probe.per_step(snaps[0], snaps[1])
    if code != 0 and (reason == "finished" or not steps):
        record["error"] = f"rlfleet up exited {code}: see {run_dir / 'up.log'}"
    return record


def logged_before(log: Path) -> dict:
    """Held-out accuracy before training, from the trainer's log line (no summary after SIGINT)."""
    import ast

    marker = "held-out before training: "
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if marker in line:
            try:
                return ast.literal_eval(line.split(marker, 1)[1].strip())
            except (ValueError, SyntaxError):
                return {}
    return {}


def phase_medians(rows: list[dict]) -> dict[str, float]:
    """Median of every ``timing_s/*`` metric over the steps given."""
    keys = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    return {
        k.removeprefix("timing_s/"): statistics.median(r[k] for r in rows if k in r) for k in keys
    }


def time_to_target(evals: list[list[float]], target: float, summary: dict) -> float | None:
    if summary.get("time_to_target_s") is not None:
        return summary["time_to_target_s"]
    return next((seconds for _, seconds, acc in evals if acc >= target), None)
