"""What the trainer leaves in the run directory, read as it grows: ``metrics.jsonl`` (one row
per step, and one per validation) and the samples files.

Why incremental: the page polls every second and a long run's file holds thousands of rows;
``MetricsTail`` reads only the bytes added since the last call. A file that shrank or was
replaced (a fresh run moves the previous run's file aside: ``rlfleet.trainer.run_record``) is
read again from the start. A resumed run appends to the file, its rows marked ``segment``: they
replace the rows of the steps it trains again and keep the earlier ones (the trainer's own
``standing_rows``). An unmarked step that goes back starts a new series, so two runs never mix
on one curve.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from rlfleet.common.config.health import HealthConfig
from rlfleet.trainer import health, report

CURVES: dict[str, tuple[str, ...]] = {
    "reward": ("critic/score/mean",),
    "kl": ("actor/kl_loss", "actor/ppo_kl", "actor/reward_kl_penalty"),
    "entropy": ("actor/entropy",),
    "response_length": ("response_length/mean",),
    "staleness": ("async/staleness/mean",),
    "step_time": ("timing_s/step",),
}
"""Curve name -> the metrics that may hold it, first present wins (KL is the loss term when the
loss has one, else the PPO KL between old and new policy, else the in-reward penalty)."""

VAL_PREFIX = report.VAL_PREFIX
"""Held-out metrics (``val-core/<source>/reward/mean@1`` ...): a row with one is a validation."""

PHASES = report.PHASES
"""Step-time phases the page stacks, the same ones the end-of-run report shows."""


class MetricsTail:
    """The rows of one ``metrics.jsonl`` so far (the current run's), read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""
        self._segment = 0
        """The ``segment`` of the last row read (0: a fresh run's rows; 1, 2 ... resumes)."""

    def read(self) -> list[dict[str, Any]]:
        """New rows appended since the last call are parsed; returns every row so far."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return self.rows
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self.rows, self._offset, self._partial, self._inode = [], 0, b"", stat.st_ino
            self._segment = 0
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            self._add(line)
        return self.rows

    def _add(self, line: bytes) -> None:
        try:
            row = json.loads(line)
        except ValueError:
            return  # a torn or foreign line is skipped, not fatal
        if not isinstance(row, dict) or "step" not in row:
            return
        segment = int(row.get("segment", 0))
        if segment > self._segment:  # a resumed run: what it trains again replaces the dead one's
            self.rows = [r for r in self.rows if r["step"] < row["step"]]
        elif self._went_back(row):
            self.rows = []  # the step went back within a segment: a new run began here
        self._segment = segment
        self.rows.append(row)

    def _went_back(self, row: dict[str, Any]) -> bool:
        if "training/global_step" not in row:
            return False
        last = next((r["step"] for r in reversed(self.rows) if "training/global_step" in r), None)
        return last is not None and row["step"] <= last


def first_of(row: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = row.get(key)
        if isinstance(value, int | float):
            return float(value)
    return None


def curves(rows: list[dict[str, Any]], max_points: int) -> dict[str, list[list[float]]]:
    """Every curve as ``[[step, value], ...]`` (training rows only), thinned to ``max_points``;
    held-out metrics as ``val:<name>`` from the validation rows."""
    out: dict[str, list[list[float]]] = {name: [] for name in CURVES}
    for row in rows:
        if "training/global_step" in row:
            for name, keys in CURVES.items():
                value = first_of(row, keys)
                if value is not None:
                    out[name].append([row["step"], value])
        for key, value in row.items():
            if key.startswith(VAL_PREFIX) and isinstance(value, int | float):
                out.setdefault("val:" + key[len(VAL_PREFIX) :], []).append([row["step"], value])
    return {name: thin(points, max_points) for name, points in out.items()}


def thin(points: list, limit: int) -> list:
    """At most ``limit`` points, evenly spaced, the last always kept."""
    if len(points) <= limit:
        return points
    stride = len(points) / (limit - 1)
    return [points[int(i * stride)] for i in range(limit - 1)] + [points[-1]]


def phases(row: dict[str, Any]) -> dict[str, float]:
    """One step row's time by phase (seconds)."""
    return {name: sum(float(row.get(k, 0.0)) for k in keys) for name, keys in PHASES.items()}


def step_times(rows: list[dict[str, Any]], window: int = 20) -> dict[str, Any]:
    """The last step's phases, the mean over the last ``window`` steps, and the step time."""
    steps = [r for r in rows if "training/global_step" in r][-window:]
    if not steps:
        return {"last": {}, "mean": {}, "step_s_mean": None, "window": 0}
    each = [phases(r) for r in steps]
    mean = {name: sum(p[name] for p in each) / len(each) for name in PHASES}
    step_s = [float(r["timing_s/step"]) for r in steps if "timing_s/step" in r]
    return {
        "last": each[-1],
        "mean": mean,
        "step_s_mean": sum(step_s) / len(step_s) if step_s else None,
        "window": len(steps),
    }


class HealthTail:
    """The run-health rules (``rlfleet.trainer.health``) over a ``MetricsTail``'s rows, fed
    only the rows added since the last call: replaying a long run's file every refresh would
    cost the page a good part of a core. Rows replaced (a new run, a resumed one's segment)
    start the rules afresh."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self._rows: list[dict[str, Any]] | None = None
        self._fed = 0
        self._monitor = health.HealthMonitor(config)

    def findings(
        self, run_dir: Path, rows: list[dict[str, Any]], now: float | None = None
    ) -> list[dict[str, str]]:
        """``{"rule", "message"}`` for each rule firing; a run not finished (no
        ``summary.json``) is also judged on its wait for the next row (the file's age)."""
        if rows is not self._rows or len(rows) < self._fed:
            self._rows, self._fed = rows, 0
            self._monitor = health.HealthMonitor(self.config)
        self._monitor.replay(rows[self._fed :])
        self._fed = len(rows)
        found = self._monitor.findings(waiting_s(run_dir, now) if rows else None)
        return [{"rule": f.rule, "message": f.message} for f in found]


def waiting_s(run_dir: Path, now: float | None = None) -> float | None:
    """Seconds since ``metrics.jsonl`` last grew, for a run not finished (else None)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or (run_dir / "summary.json").exists():
        return None
    return (now or time.time()) - metrics.stat().st_mtime


def health_findings(
    run_dir: Path, rows: list[dict[str, Any]], config: HealthConfig, now: float | None = None
) -> list[dict[str, str]]:
    """``HealthTail.findings`` of all ``rows`` at once (``rlfleet status``)."""
    return HealthTail(config).findings(run_dir, rows, now)


def tail_jsonl(path: Path, limit: int, block: int = 1 << 16) -> list[dict[str, Any]]:
    """The last ``limit`` JSON rows of a file, reading only its end (samples files grow)."""
    if limit <= 0:
        return []
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - block))
            data = handle.read()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if size > block:
        lines = lines[1:]  # the first may be cut in the middle
    rows: deque[dict[str, Any]] = deque(maxlen=limit)
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return list(rows)
