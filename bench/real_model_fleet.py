"""One ``rlfleet up`` run of a SmolLM2 recipe (countdown, or basic math for the ``learn``
section), watched from outside, for bench_real_model.py's ``grpo`` and ``learn`` sections.

Why from outside: the number that counts is what a user's ``rlfleet up`` does, every role in
its own process over real gRPC and Redis. The run gets its own embedded Redis; s/step and its
phases come from ``run_dir/metrics.jsonl`` (``timing_s/*``, the trainer's own clock), held-out
success before and after from ``summary.json`` (``val_before`` / ``val_after``), and the peak
RSS of every role process from ``/proc/PID/status`` (``VmHWM``), sampled while the run lives
(a process's peak is gone once it exits). A training-time budget ends the run through the
trainer's own ``Stop`` call, so the loop finishes its step, validates and writes its summary
as at a normal end (SIGINT would skip both).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import common
import e2e_fleet
import e2e_probe

CONFIG = common.REPO / "configs" / "grpo_countdown_smollm2.yaml"
ACCURACY_KEY = "val-core/countdown/reward/mean@1"
POLL_S = 0.5


@dataclass
class GrpoFleetRun:
    """One job: ``steps`` caps ``trainer.total_steps``; ``budget_s`` > 0 stops it earlier, once
    that much training time (the trainer's step clock) is spent."""

    mode: str
    steps: int
    val_size: int
    budget_s: float = 0.0
    overrides: list[str] = field(default_factory=list)
    config: Path = CONFIG
    accuracy_key: str = ACCURACY_KEY
    """The held-out number reported (before, after, and at each periodic validation)."""

    @property
    def name(self) -> str:
        return f"fleet-{self.mode}"

    def argv(self, run_dir: Path, redis_url: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "up",
            "--config",
            str(self.config),
            "--rollout-replicas",
            "1",
            f"run_dir={run_dir}",
            f"redis_url={redis_url}",
            f"trainer.mode={self.mode}",
            f"trainer.total_steps={self.steps}",
            f"data.val_size={self.val_size}",
            "trainer.test_freq=0",
            "trainer.val_before_train=true",
            "trainer.save_freq=0",
            *self.overrides,
        ]


def run_fleet(run: GrpoFleetRun, work_dir: Path, timeout_s: float) -> dict:
    """Run the job to its end (steps, budget or timeout); what was measured about it."""
    from rlfleet.common.redis_server import EmbeddedRedis

    run_dir = work_dir / run.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    load_before = common.load_avg()
    with EmbeddedRedis(run_dir / "redis-bench") as redis_server:
        record = _watch(run, run_dir, redis_server.url, timeout_s)
    record["load_avg"] = {"before": load_before, "after": common.load_avg()}
    return record


def _watch(run: GrpoFleetRun, run_dir: Path, redis_url: str, timeout_s: float) -> dict:
    log = (run_dir / "up.log").open("wb")
    started = time.perf_counter()
    proc = subprocess.Popen(
        run.argv(run_dir, redis_url),
        cwd=common.REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    tree, peaks = e2e_probe.ProcessTree(proc.pid), PeakRss()
    tail = e2e_fleet.MetricsTail(run_dir / "metrics.jsonl")
    reason = None
    try:
        reason = _follow(run, proc, tree, peaks, tail, time.monotonic() + timeout_s)
    finally:
        e2e_fleet._stop(proc)  # SIGINT, then SIGTERM/SIGKILL, and no role left behind
        log.close()
    tail.poll()
    record = _record(run, run_dir, proc.returncode, reason, tail)
    record["wall_time_s"] = time.perf_counter() - started
    record["peak_rss_GB"] = peaks.by_label()
    return record


def _follow(run, proc, tree, peaks: PeakRss, tail, deadline: float) -> str:
    """Poll until the job ends; ask the trainer to stop once the budget is spent."""
    stop_sent = False
    while proc.poll() is None:
        time.sleep(POLL_S)
        tail.poll()
        peaks.sample(tree)
        if run.budget_s and not stop_sent and tail.training_s() >= run.budget_s:
            stop_sent = _ask_stop(tree)
        if time.monotonic() > deadline:
            return "timeout"
    return "budget spent" if stop_sent else "finished"


class PeakRss:
    """The largest ``VmHWM`` seen for each process of the run, by role label."""

    def __init__(self) -> None:
        self.kb: dict[int, int] = {}
        self.labels: dict[int, str] = {}

    def sample(self, tree: e2e_probe.ProcessTree) -> None:
        for proc in tree.processes():
            kb = common.vm_hwm_kb(proc.pid)
            if kb:
                self.kb[proc.pid] = max(kb, self.kb.get(proc.pid, 0))
                self.labels[proc.pid] = tree._label(proc)

    def by_label(self) -> dict[str, float]:
        """GiB per role: the largest single process under that label (the per-process
        figure the 3 GB target reads; vLLM's engine core counts under its replica)."""
        out: dict[str, float] = {}
        for pid, kb in self.kb.items():
            label = self.labels[pid]
            out[label] = max(out.get(label, 0.0), kb / 2**20)
        return dict(sorted(out.items()))


def _ask_stop(tree: e2e_probe.ProcessTree) -> bool:
    """The trainer's ``Stop`` RPC, on the port ``rlfleet up`` gave it (its command line)."""
    import grpc

    from rlfleet.proto import common_pb2, trainer_pb2_grpc

    port = next(
        (
            a.split("=", 1)[1]
            for p in tree.processes()
            if tree._label(p) == "trainer"
            for a in _cmdline(p)
            if a.startswith("trainer.port=")
        ),
        None,
    )
    if port is None:
        return False
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            trainer_pb2_grpc.TrainerStub(channel).Stop(common_pb2.Empty(), timeout=10)
        except grpc.RpcError as exc:
            common.progress(f"trainer Stop failed: {exc}")
            return False
    common.progress("training budget spent: trainer asked to stop")
    return True


def _cmdline(proc) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:  # noqa: BLE001 - gone
        return []


def finished_run(run: GrpoFleetRun, run_dir: Path) -> dict:
    """The record of a run that ended already (its ``summary.json`` and ``metrics.jsonl``),
    for a side taken from a user's own ``rlfleet up``: the peak RSS of its roles is what
    ``rlfleet up`` recorded in ``peak_rss.json`` (GiB, as ``PeakRss``), when it did."""
    tail = e2e_fleet.MetricsTail(run_dir / "metrics.jsonl")
    tail.poll()
    done = (run_dir / "summary.json").is_file()
    record = _record(run, run_dir, 0 if done else None, "finished" if done else "unknown", tail)
    record["from_run_dir"] = str(run_dir)
    peaks = run_dir / "peak_rss.json"
    if peaks.is_file():
        record["peak_rss_GB"] = json.loads(peaks.read_text())["peak_rss_GiB"]
    return record


def _curve(key: str, rows: list[dict], record: dict) -> list[list[float]]:
    """[step, training seconds, held-out accuracy]: before, each periodic validation, after."""
    points = [[r["step"], r.get("training/time_s", 0.0), r[key]] for r in rows if key in r]
    if record["val_before"] is not None:
        points.insert(0, [0, 0.0, record["val_before"]])
    if record["val_after"] is not None:
        points.append([record["steps_done"], record["training_time_s"], record["val_after"]])
    return points


def _record(run: GrpoFleetRun, run_dir: Path, code, reason, tail) -> dict:
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    steps = [r for r in tail.rows if "timing_s/step" in r]
    record = {
        "run": run.name,
        "mode": run.mode,
        "exit_code": code,
        "stopped_by": reason,
        "steps_done": tail.step,
        "summary": summary,
        "training_time_s": summary.get("training_time_s", tail.training_s()),
        "steps": [
            {
                "index": r["step"],
                "phase": "sft" if any(k.startswith("sft/") for k in r) else "rl",
                **{
                    k.removeprefix("timing_s/"): v
                    for k, v in r.items()
                    if k.startswith("timing_s/")
                },
            }
            for r in steps
        ],
        "reward": [[r["step"], r["critic/score/mean"]] for r in steps if "critic/score/mean" in r],
        "val_before": (summary.get("val_before") or {}).get(run.accuracy_key),
        "val_after": (summary.get("val_after") or {}).get(run.accuracy_key),
    }
    record["curve"] = _curve(run.accuracy_key, tail.rows, record)
    if code != 0 or not summary:
        tail_text = (run_dir / "up.log").read_text(errors="replace")[-1500:]
        record["error"] = f"rlfleet up exited {code} ({reason}): {tail_text}"
    return record
