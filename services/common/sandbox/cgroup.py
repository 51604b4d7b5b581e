"""A pids cgroup per sandbox call: the process bound that holds for root too, and a kill list.

Why: ``RLIMIT_NPROC`` does not bind root, and the audit hook does not see
``_posixsubprocess.fork_exec``; the pids controller caps the tasks of a cgroup whoever makes
them. The service makes one cgroup per call under its own (``rlfleet-sandbox/PID-N``, with
``pids.max``), the sandbox's keeper moves itself in before anything else runs, and the service
removes it when the call is over, SIGKILLing whatever is still listed first (what makes "every
process of the call is dead" hold even without a pid namespace). Where no pids hierarchy is
writable (not root, no delegation) ``create`` returns None and the sandbox goes without.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import signal
from pathlib import Path

log = logging.getLogger(__name__)

GROUP = "rlfleet-sandbox"
REMOVE_TRIES = 400  # of 5 ms: what SIGKILLed processes take to be reaped, generously
_numbers = itertools.count()


@functools.cache
def pids_root() -> Path | None:
    """``rlfleet-sandbox`` under this process's pids cgroup (v1, or v2 with the controller
    delegated), created once; None where there is none we may write."""
    try:
        found = _own_pids_cgroup()
        if found is None:
            return None
        root = found / GROUP
        root.mkdir(exist_ok=True)
        _delegate_v2(found, root)
        _remove_stale(root)
    except (OSError, ValueError, IndexError):
        return None
    return root


def _delegate_v2(found: Path, root: Path) -> None:
    """cgroup v2: the pids controller must reach ``root``'s children (only the root cgroup
    may enable it for itself while it holds processes); OSError where it cannot."""
    if not (found / "cgroup.subtree_control").exists():
        return  # v1: every cgroup of the hierarchy has pids.max
    with contextlib.suppress(OSError):
        (found / "cgroup.subtree_control").write_text("+pids")
    try:
        (root / "cgroup.subtree_control").write_text("+pids")
    except OSError:
        with contextlib.suppress(OSError):
            root.rmdir()
        raise


def _own_pids_cgroup() -> Path | None:
    """This process's cgroup directory in the hierarchy that has the pids controller."""
    mounts = {}
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            tail = fields[fields.index("-") + 1 :]
            if tail[0] == "cgroup" and "pids" in tail[2].split(","):
                mounts["v1"] = (Path(fields[4]), fields[3])
            elif tail[0] == "cgroup2":
                mounts.setdefault("v2", (Path(fields[4]), fields[3]))
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        version = "v1" if "pids" in controllers.split(",") else "v2" if not controllers else ""
        if version in mounts and (version == "v1" or "v1" not in mounts):
            mount, root = mounts[version]
            where = mount / os.path.relpath(path, root)
            if version == "v1" or "pids" in (where / "cgroup.controllers").read_text().split():
                return where
    return None


def _remove_stale(root: Path) -> None:
    """Empty cgroups left by services that were killed (named after their pid; one that had
    our pid before us is dead too, as we have made none yet)."""
    for entry in root.iterdir():
        owner = entry.name.split("-")[0]
        if owner.isdigit() and (owner == str(os.getpid()) or not Path(f"/proc/{owner}").exists()):
            with contextlib.suppress(OSError):
                entry.rmdir()


def create(processes: int) -> Path | None:
    """A new cgroup allowing ``processes`` tasks for the user's code (plus the sandbox's own
    keeper and init); None where cgroups are not available."""
    root = pids_root()
    if root is None:
        return None
    path = root / f"{os.getpid()}-{next(_numbers)}"
    try:
        path.mkdir()
        (path / "pids.max").write_text(str(processes + 2))
    except OSError as exc:
        log.warning("sandbox: no pids cgroup for this call (%s)", exc)
        with contextlib.suppress(OSError):
            path.rmdir()
        return None
    return path


async def remove(path: Path) -> None:
    """SIGKILL what is still in ``path``, wait until the kernel has let it go, remove it."""
    for _ in range(REMOVE_TRIES):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            kill_all(path)
        await asyncio.sleep(0.005)
    log.warning("sandbox: cgroup %s still busy; left behind", path)


async def empty(path: Path, spare: frozenset[int]) -> None:
    """SIGKILL every process in ``path`` but those in ``spare``, until none is left."""
    for _ in range(REMOVE_TRIES):
        if not kill_all(path, spare):
            return
        await asyncio.sleep(0.005)


def kill_all(path: Path, spare: frozenset[int] = frozenset()) -> bool:
    """SIGKILL every process in ``path`` but those in ``spare``; whether there was one."""
    try:
        listed = [int(pid) for pid in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return False
    doomed = [pid for pid in listed if pid not in spare]
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return bool(doomed)
