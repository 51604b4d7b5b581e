"""Each role's peak memory, as the machine saw it: ``run_dir/peak_rss.json``.

Why: "no role above 4 GB" is a target users hold a fleet to (a container's memory limit is per
process tree), and a role's own metrics cannot see its helpers (vLLM's engine core and worker
are processes of their own). ``rlfleet up`` starts every role in a process group of its own, so
the launcher reads ``VmHWM`` (the kernel's high-water mark of resident memory) of every process
in each group, now and then while the run goes on, and keeps the largest per process. A role's
peak is its largest process's; the file lists every process too, by its name (``comm``).

Linux only: where ``/proc`` has no ``status`` files the file is not written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
SAMPLE_EVERY_S = 2.0
"""How often the groups are read: ``VmHWM`` only grows, so a sample misses nothing of a
process that is still alive; one that exits between samples loses at most this much."""


def read_status(pid: int, proc: Path = PROC) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict (empty when the process is gone)."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def kib(value: str | None) -> int:
    """``"123 kB"`` -> 123 (0 for a missing field: kernel threads have no VmHWM)."""
    return int(value.split()[0]) if value else 0


def group_members(pgids: Iterable[int], proc: Path = PROC) -> dict[int, list[int]]:
    """The pids of every process in each of the process groups ``pgids``."""
    wanted: dict[int, list[int]] = {pgid: [] for pgid in pgids}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:  # the field after the parenthesised name: state, ppid, pgrp
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        pgrp = int(stat.rsplit(")", 1)[1].split()[2])
        if pgrp in wanted:
            wanted[pgrp].append(int(entry.name))
    return wanted


@dataclass
class PeakMemory:
    """The largest ``VmHWM`` seen of each process of each role, and where to write them."""

    path: Path
    proc: Path = PROC
    peaks_kib: dict[str, dict[str, int]] = field(default_factory=dict)
    _last: float = 0.0

    def sample(self, groups: dict[str, int], force: bool = False) -> None:
        """Read the groups (role name -> process group id) when ``SAMPLE_EVERY_S`` has passed
        since the last read (or ``force``), and rewrite the file when a peak grew."""
        now = time.monotonic()
        if not force and now - self._last < SAMPLE_EVERY_S:
            return
        self._last = now
        if not (self.proc / str(os.getpid()) / "status").exists():
            return
        members = group_members(groups.values(), self.proc)
        grew = False
        for role, pgid in groups.items():
            for pid in members.get(pgid, []):
                status = read_status(pid, self.proc)
                name = f"{status.get('Name', '?').strip()}[{pid}]"
                peak = kib(status.get("VmHWM"))
                known = self.peaks_kib.setdefault(role, {})
                if peak > known.get(name, 0):
                    known[name], grew = peak, True
        if grew:
            self.write()

    def by_role_gib(self) -> dict[str, float]:
        """Each role's peak: its largest process's, in GiB."""
        return {
            role: round(max(procs.values()) / 2**20, 3)
            for role, procs in self.peaks_kib.items()
            if procs
        }

    def write(self) -> None:
        record = {
            "peak_rss_GiB": self.by_role_gib(),
            "processes_GiB": {
                role: {name: round(v / 2**20, 3) for name, v in procs.items()}
                for role, procs in self.peaks_kib.items()
            },
            "how": "VmHWM of every process in each role's process group, read every "
            f"{SAMPLE_EVERY_S:g} s by rlfleet up",
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.replace(self.path)

    def summary_line(self) -> str:
        """``peak RSS (GiB): trainer 6.49, rollout-0 3.26, ...``, largest first."""
        peaks = sorted(self.by_role_gib().items(), key=lambda item: -item[1])
        return "peak RSS (GiB): " + ", ".join(f"{role} {gb:.2f}" for role, gb in peaks)
