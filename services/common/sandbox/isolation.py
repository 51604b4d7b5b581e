"""Kernel isolation of one sandbox: a keeper, namespaces, an init, and no capabilities left.

Why: the audit hook (``guard``) sees only what Python reports; ``_posixsubprocess.fork_exec``,
``sqlite3`` and any native code go around it. What binds those is the kernel, so before any
user code runs the child sets up, where the machine allows it, this process tree:

    service ── keeper: outside the namespaces; what the service signals and waits for
                 └── init: pid 1 of a new pid namespace; mounts the filesystem read-only,
                       │    drops every capability, reaps orphans
                       └── worker: limits, the audit hook, then the user's code

- The keeper joins the call's pids cgroup (``cgroup``, made by the service: it bounds process
  creation however it is made, root included), unshares the pid, mount, network, IPC and UTS
  namespaces (through a user namespace when not root) and forks init. SIGTERM makes it SIGKILL
  init; it exits only once init is reaped, and the kernel reaps a pid namespace's init only
  after every other process in it is dead. So when the service sees its child gone, nothing of
  the call is left. It exits with the worker's status (a signal as the same signal).
- init sees only its namespace (its own ``/proc``: no service environment, argv or pids), and
  neither it nor anything below it keeps a capability (the bounding set is empty and
  ``no_new_privs`` is set, so no exec regains one): it cannot remount, mount, or reach out.

Where namespaces are refused (a container without ``CAP_SYS_ADMIN`` and without user
namespaces) the keeper forks the worker directly, in a process group of its own that SIGTERM
kills; processes that leave the group are then only bounded and killed by the cgroup (where the
service could make one) or ``RLIMIT_NPROC`` (non-root). ``Isolation`` says what was achieved.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import select
import signal
import time
from typing import Any, NoReturn

from rlfleet.common.sandbox import mounts

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
ALL_BUT_USER = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
NAMESPACES = {
    CLONE_NEWUSER: "user",
    CLONE_NEWPID: "pid",
    CLONE_NEWNS: "mount",
    CLONE_NEWNET: "net",
    CLONE_NEWIPC: "ipc",
    CLONE_NEWUTS: "uts",
}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
CAPABILITY_VERSION_3 = 0x20080522
LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before the audit hook refuses ctypes


class Isolation:
    """What the kernel enforces for this sandbox (the service logs it once; docs list it).
    A plain class: ``dataclasses`` would cost the child ~50 ms of imports at every start."""

    def __init__(self, cgroup: bool) -> None:
        self.namespaces: list[str] = []
        self.fallback = ""
        """Why some namespaces are missing ("" when all were entered)."""
        self.cgroup = cgroup
        """In a pids cgroup of its own (``pids.max``: the process bound, root included)."""
        self.readonly = False
        """Every mount read-only but the sandbox directory."""
        self.writable: list[str] = []
        """Mounts that stayed writable (could not be remounted)."""
        self.proc = "host"
        """``own`` (a /proc of its pid namespace), ``hidden`` (an empty one) or ``host``."""
        self.capabilities = True
        """Whether the worker could still hold a capability (False: all dropped)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def isolate(spec: dict[str, Any]) -> Isolation:
    """Confine what comes next; returns only in the worker (the keeper and init exit in here)."""
    die_with_parent(spec["parent_pid"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # also when the keeper mirrors a signal
    found = Isolation(join_cgroup(spec.get("cgroup")))
    flags, found.fallback = enter_namespaces()
    found.namespaces = _names(flags)
    own_pids = bool(flags & CLONE_NEWPID)
    status_w = _split_off_keeper(own_pids)
    if own_pids:
        _become_init(found, spec["workdir"], status_w)
    else:
        os.setpgid(0, 0)  # the group the keeper kills
        os.close(status_w)
        found.capabilities = not drop_capabilities()
    return found


def _split_off_keeper(own_pids: bool) -> int:
    """Fork: this process stays behind as the keeper (and never returns); the child returns
    its end of the pipe that carries the worker's exit status to the keeper."""
    status_r, status_w = os.pipe()
    pid = _fork_with_signals_held()
    if pid:
        os.close(status_w)
        keep(pid, status_r, own_pids)
    os.close(status_r)
    if _keeper_gone(status_w):
        os._exit(1)
    return status_w


def _become_init(found: Isolation, workdir: str, status_w: int) -> None:
    """As pid 1 of the new namespace: the mounts, no capability, then the worker; returns in
    the worker (init itself stays in ``run_init``)."""
    try:
        found.readonly, found.writable, found.proc = mounts.confine_filesystem(workdir)
    except OSError as exc:  # the namespace is private: a half-done setup harms nobody else
        found.writable = [str(exc)]
    found.capabilities = not drop_capabilities()
    worker = os.fork()
    if worker:
        run_init(worker, status_w)
    os.close(status_w)


def die_with_parent(parent_pid: int) -> None:
    """A SIGKILLed service must not leave its sandboxes running."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def join_cgroup(path: str | None) -> bool:
    """Move this process (and so all it starts) into the call's pids cgroup."""
    if not path:
        return False
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    except OSError:
        return False
    return True


def unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
    elif LIBC.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def enter_namespaces() -> tuple[int, str]:
    """The namespaces this process entered (flags), and why not all, where it fell back."""
    uid, gid = os.geteuid(), os.getegid()
    reasons = []
    for flags in (ALL_BUT_USER, ALL_BUT_USER | CLONE_NEWUSER, CLONE_NEWNET):
        try:
            unshare(flags)
        except OSError as exc:
            reasons.append(f"unshare({'+'.join(_names(flags))}): {exc.strerror}")
            continue
        if flags & CLONE_NEWUSER:
            _map_to_root(uid, gid)
        return flags, "; ".join(reasons)
    return 0, "; ".join(reasons)


def _names(flags: int) -> list[str]:
    return [name for bit, name in NAMESPACES.items() if flags & bit]


def _map_to_root(uid: int, gid: int) -> None:
    """In a new user namespace: be its root, mapped to our own ids. Best effort: mapping uid 0
    needs CAP_SETFCAP (Linux 5.12+), and unmapped we still hold the namespace's capabilities,
    which is all mounting needs."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with contextlib.suppress(OSError), open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _fork_with_signals_held() -> int:
    """fork() with SIGTERM held back until the keeper has its handler (no early death); the
    child dies with the keeper."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return pid


def _keeper_gone(status_w: int) -> bool:
    """Whether the keeper died before ``PR_SET_PDEATHSIG`` took effect (its end of the status
    pipe is closed; in a pid namespace ``getppid`` cannot tell)."""
    poll = select.poll()
    poll.register(status_w, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def keep(child: int, status_r: int, own_pids: bool) -> NoReturn:
    """The keeper: wait for init (or the worker), kill it on SIGTERM, exit as the worker did."""
    if not own_pids:
        with contextlib.suppress(OSError):
            os.setpgid(child, child)

    def stop(*_: Any) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            (os.kill if own_pids else os.killpg)(child, signal.SIGKILL)

    signal.signal(signal.SIGTERM, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _quiet_stdio()
    _, status = os.waitpid(child, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # its pid is free now: never signal it again
    if not own_pids:
        stop()  # what the worker left in its group goes with it
    reported = os.read(status_r, 32) if select.select([status_r], [], [], 0)[0] else b""
    exit_like(int(reported) if reported.strip() else status)


def run_init(worker: int, status_w: int) -> NoReturn:
    """pid 1: reap every orphan until the worker ends, pass its status on, and exit (which
    kills whatever is left in the namespace)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a pid-1 with no handler ignores its own ns
    _quiet_stdio()
    while True:
        pid, status = os.wait()
        if pid == worker:
            break
    os.write(status_w, b"%d\n" % status)
    os._exit(0)


def _quiet_stdio() -> None:
    """Let go of the pipes to the service: their end of file is the worker's."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def exit_like(status: int) -> NoReturn:
    """End this process the way ``status`` (a wait status) says another one ended."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def drop_capabilities() -> bool:
    """Empty the bounding set, set ``no_new_privs`` (no exec regains a capability, not even
    root's) and hold none: True when the last two took (the first needs CAP_SETPCAP)."""
    for cap in range(64):  # past the kernel's last capability prctl fails harmlessly
        LIBC.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)
    no_new = LIBC.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), 0, 0, 0) == 0
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    return no_new and LIBC.capset(header, (ctypes.c_uint32 * 6)()) == 0


def kill_leftovers(timeout_s: float = 2.0) -> None:
    """SIGKILL every other process of this pid namespace but init, and wait until they are
    dead (a serving worker's end of a call). ``kill(-1)`` signals all at once, and a fork
    racing it is cancelled by the kernel; only ever called where the worker has a pid
    namespace (and /proc) of its own."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            nobody = True  # the usual case: the call started nothing
        else:
            nobody = False
        reap_children()
        if nobody or not _others_alive():
            return
        time.sleep(0.001)


def reap_children() -> None:
    """Collect this process's dead children (a zombie still counts against the cgroup)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _others_alive() -> bool:
    """Whether a process other than init and this one is alive (not a zombie) in /proc."""
    mine = {"1", str(os.getpid())}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in mine:
            continue
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            return True
    return False
