"""One run, one record: a fresh run moves the previous run's files aside before it writes.

Why move rather than delete or append: ``metrics.jsonl`` is appended to (a resumed run goes on
in the same file, its rows marked ``segment``), so a second fresh run in the same ``run_dir``
used to add its steps to the first run's and mix their curves. Moving the previous record into
``run_dir/previous/<time>/`` (when it ended: its summary's time) keeps every number of it and
leaves ``run_dir`` holding one run, so everything that reads ``run_dir/metrics.jsonl`` (the
dashboard, the tests, scripts) needs no new path. A resume moves nothing.

What moves is what the trainer writes about the run: the metrics, the samples, the data order,
the pictures, the summary, the checkpoints (a fresh run must not resume, later, from the
previous run's steps) and TensorBoard's event files. What the launcher writes for the processes
now running (``endpoints.json``, ``config.*.yaml``, ``logs/``, the embedded Redis) stays: those
files are already this run's, open and being written, when the trainer starts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

RECORD = (
    "metrics.jsonl",
    "train_samples.jsonl",
    "data_order.jsonl",
    "val_samples.jsonl",
    "reward_curve.png",
    "report.html",
    "summary.json",
    "checkpoints",
    "tensorboard",
)
"""The names in ``run_dir`` that belong to one run's record."""

PREVIOUS = "previous"


def set_aside_previous(run_dir: Path) -> Path | None:
    """Move the previous run's record into ``run_dir/previous/<time>/``; returns that
    directory, or None when there was nothing to move."""
    found = [run_dir / name for name in RECORD if (run_dir / name).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(last_written(found)))
    target = unused(run_dir / PREVIOUS / stamp)
    target.mkdir(parents=True)
    for path in found:
        path.rename(target / path.name)
    log.info("a fresh run: the previous run's files are now in %s", target)
    return target


def last_written(found: list[Path]) -> float:
    """When the previous run ended: its summary's time, else its last metrics row's, else
    the newest of its files'."""
    for name in ("summary.json", "metrics.jsonl"):
        path = next((p for p in found if p.name == name), None)
        if path is not None:
            return path.stat().st_mtime
    return max(path.stat().st_mtime for path in found)


def unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3`` ... when it exists (two runs in the same second)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate
