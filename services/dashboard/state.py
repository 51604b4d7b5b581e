"""The one JSON document the page draws, refreshed in the background every ``refresh_s``
while someone reads it.

Why a background loop rather than work per request: any number of open pages cost the fleet
one probe a period, and a request never waits on a slow role; it gets the latest document,
whose ``updated_at`` says how fresh it is. Why only while read: probing every role and
re-reading the run's files each second took ~13% of a core on the 2-core default job, whose
step shares those cores; with no request for ``dashboard.idle_after_s`` the loop sleeps until
the next one, which then waits for one refresh rather than getting an old document.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from rlfleet.common.config import RlfleetConfig
from rlfleet.dashboard import runfiles
from rlfleet.dashboard.probe import FleetProbe

log = logging.getLogger(__name__)

TRAIN_SAMPLES = "train_samples.jsonl"  # written by rlfleet.trainer.samples
VAL_SAMPLES = "val_samples.jsonl"  # written by rlfleet.trainer.loggers


def config_summary(config: RlfleetConfig) -> dict[str, Any]:
    """What the run is, in a dozen fields (the whole config is ``run_dir/config.*.yaml``)."""
    t, a, d, r = config.trainer, config.algorithm, config.data, config.rollout
    return {
        "run_dir": str(config.run_dir),
        "cluster": config.cluster,
        "model": config.model.path,
        "algorithm": a.adv_estimator,
        "mode": t.mode,
        "max_staleness": t.max_staleness,
        "total_steps": t.total_steps,
        "train_batch_size": d.train_batch_size,
        "n": r.n,
        "max_tokens": r.max_tokens,
        "lr": t.lr,
        "backend": r.backend,
        "test_freq": t.test_freq,
        "target_accuracy": t.target_accuracy,
    }


def time_left(rows: list[dict], total_steps: int, started_at: float) -> dict[str, Any]:
    """Steps done, seconds per step (mean of the last 20), and the seconds left at that pace."""
    steps = [r for r in rows if "training/global_step" in r]
    done = int(steps[-1]["step"]) if steps else 0
    recent = [float(r["timing_s/step"]) for r in steps[-20:] if "timing_s/step" in r]
    per_step = sum(recent) / len(recent) if recent else None
    left = None if per_step is None else round(max(0, total_steps - done) * per_step, 1)
    return {
        "step": done,
        "total_steps": total_steps,
        "s_per_step": per_step,
        "seconds_left": left,
        "dashboard_up_s": round(time.time() - started_at, 1),
    }


class DashboardState:
    """Holds the latest document; ``run()`` keeps it fresh until cancelled."""

    def __init__(self, config: RlfleetConfig, probe: FleetProbe | None = None) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.probe = probe or FleetProbe(config)
        self.metrics = runfiles.MetricsTail(self.run_dir / "metrics.jsonl")
        self.health = runfiles.HealthTail(config.trainer.health)
        self.started_at = time.time()
        self.document: dict[str, Any] = {"updated_at": None, "version": 0}
        self._last_read = -float("inf")  # time.monotonic() of the last reader's request
        self._read = asyncio.Event()  # set by a reader; wakes an idle loop
        self._refreshing = asyncio.Lock()  # one refresh at a time (loop or a waking reader)
        self.idle = False
        """True while ``run`` waits for a reader (probing nothing)."""

    async def latest(self) -> dict[str, Any]:
        """The document for a reader (``GET /api/state``): keeps the loop refreshing, and
        refreshes first when the loop was idle, so a reader never gets a document gone stale."""
        self._last_read = time.monotonic()
        self._read.set()
        if self._stale():
            async with self._refreshing:
                if self._stale():  # another reader may have refreshed it meanwhile
                    await self.refresh()
        return self.document

    def watched(self) -> bool:
        """A reader asked within ``dashboard.idle_after_s``."""
        return time.monotonic() - self._last_read < self.config.dashboard.idle_after_s

    def _stale(self) -> bool:
        updated = self.document.get("updated_at")
        return updated is None or time.time() - updated > 2 * self.config.dashboard.refresh_s

    def run_part(self) -> dict[str, Any]:
        """Everything read from the run directory (no network)."""
        cfg = self.config.dashboard
        rows = self.metrics.read()
        return {
            "curves": runfiles.curves(rows, cfg.max_points),
            "step_time": runfiles.step_times(rows),
            "progress": time_left(rows, self.config.trainer.total_steps, self.started_at),
            "samples": {
                "validation": runfiles.tail_jsonl(self.run_dir / VAL_SAMPLES, cfg.samples),
                "training": runfiles.tail_jsonl(self.run_dir / TRAIN_SAMPLES, cfg.samples),
            },
            "config": config_summary(self.config),
            "health": self.health.findings(self.run_dir, rows),
        }

    async def refresh(self) -> dict[str, Any]:
        fleet = await self.probe.fleet()
        run = await asyncio.to_thread(self.run_part)
        self.document = {
            **run,
            "fleet": fleet,
            "updated_at": time.time(),
            "version": self.document["version"] + 1,
        }
        return self.document

    async def run(self) -> None:
        period = self.config.dashboard.refresh_s
        while True:
            if not self.watched():
                self._read.clear()
                self.idle = True
                await self._read.wait()  # nobody reads the page: probe nothing
                self.idle = False
            started = time.monotonic()
            try:
                async with self._refreshing:
                    await self.refresh()
            except Exception:  # noqa: BLE001 - the next period tries again; the page shows age
                log.warning("dashboard refresh failed", exc_info=True)
            await asyncio.sleep(max(0.05, period - (time.monotonic() - started)))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.probe.close()
