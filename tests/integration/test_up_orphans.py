"""A launcher killed outright (SIGKILL: no handler runs) leaves no role process behind.

Every role is started behind ``setpriv --pdeathsig TERM`` (``rlfleet.common.pdeathsig``), so the
kernel sends each one SIGTERM when `rlfleet up` dies; the embedded Redis goes the same way. A
role whose graceful stop hangs ends itself after ``grpc_server.STOP_DEADLINE_S``.
Before, two whole fleets outlived the test runs that killed their launchers.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from procs import ServiceProcess
from up_proc import up_argv

pytestmark = pytest.mark.slow


def processes_of(run_dir: Path) -> list[int]:
    """PIDs whose command line names ``run_dir`` (every role gets ``run_dir=...``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if str(run_dir) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def describe(pids: list[int]) -> list[str]:
    """Each PID's state and command line, so a failure says which role stayed and where."""
    described = []
    for pid in pids:
        try:
            status = (Path("/proc") / str(pid) / "status").read_text().splitlines()
            state = next((line for line in status if line.startswith("State:")), "State: ?")
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
            described.append(f"{pid} {state} {argv.decode(errors='replace')[:300]}")
        except OSError:
            described.append(f"{pid} (gone)")
    return described


def test_a_sigkilled_launcher_takes_its_roles_with_it(tmp_path):
    run_dir = tmp_path / "run"
    up = ServiceProcess.start(
        up_argv(run_dir, "hf", 100_000, [], replicas=1), tmp_path / "up.log", name="rlfleet up"
    )
    try:
        up.wait_until(lambda: len(processes_of(run_dir)) >= 5, 120, "the roles to start")
        os.kill(up.pid, signal.SIGKILL)
        up.wait(timeout=10)
        deadline = time.monotonic() + 30
        while processes_of(run_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = processes_of(run_dir)
        assert not left, f"still running after the launcher died: {describe(left)}"
    finally:
        for pid in processes_of(run_dir):
            os.kill(pid, signal.SIGKILL)
