"""The child side of the reward sandbox: confine this process, then run a program or serve calls.

Started by ``rlfleet.reward.sandbox`` as ``python -I -m rlfleet.reward.sandbox_child MODE
SPEC_JSON`` in its own session, with a scrubbed environment and an empty temporary directory as
its working directory. Only the standard library is imported before ``confine`` runs, so user
code never runs unconfined. Two layers, because the kernel's help depends on the machine:

- kernel: rlimits (CPU, address space, file size, process count, no core files), a new network
  namespace with no interfaces when ``unshare(CLONE_NEWNET)`` is permitted, death with the
  parent (``PR_SET_PDEATHSIG``); the parent kills the whole process group after each run;
- a Python audit hook (PEP 578), everywhere: no new processes, sockets, signals to others,
  ``ctypes`` libraries or rlimit changes, and no writes, renames or deletions outside the
  working directory. Native code can get around it; the kernel layer is what binds then.

Modes: ``exec`` runs a program file (the ``code`` scorer); ``serve`` loads a user function and
answers scoring calls, one JSON line in and one out, on a private copy of stdout (fd 1 itself
goes to /dev/null, so the function's prints cannot corrupt the replies).
"""

from __future__ import annotations

import ctypes  # imported before the audit hook, which refuses loading libraries afterwards
import json
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MIB = 1 << 20
BLOCKED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
    "socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata",
    "resource.setrlimit", "resource.prlimit", "os.setuid", "os.setgid", "sys.remote_exec",
})  # fmt: skip
PATH_EVENTS = frozenset({
    "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
    "os.symlink", "os.link", "os.rename", "shutil.rmtree", "shutil.move", "shutil.copyfile",
})  # fmt: skip
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def confine(limits: dict[str, Any], parent_pid: int) -> tuple[bool, Callable[[bool], None]]:
    """Apply every limit to this process: (whether it now has no network at all, the guard's
    switch for this module's own rlimit changes)."""
    _die_with_parent(parent_pid)
    set_limits(limits)
    isolated = _unshare_network()
    sys.dont_write_bytecode = True
    return isolated, install_guard(os.getcwd())


def _die_with_parent(parent_pid: int) -> None:
    """A SIGKILLed reward worker must not leave its sandboxes running."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def set_limits(limits: dict[str, Any]) -> None:
    def cap(kind: int, value: int) -> None:
        resource.setrlimit(kind, (value, value))

    cap(resource.RLIMIT_AS, int(limits["memory_mb"]) * MIB)
    cap(resource.RLIMIT_FSIZE, int(limits["file_size_mb"]) * MIB)
    cap(resource.RLIMIT_NPROC, int(limits["processes"]))
    cap(resource.RLIMIT_CORE, 0)
    cpu = max(1, int(float(limits["cpu_s"]) + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an over-long write fails, not the process


def _unshare_network() -> bool:
    """A network namespace of our own (no interfaces); False where that is not permitted."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(CLONE_NEWNET) == 0


def install_guard(root: str) -> Callable[[bool], None]:
    """Install the audit hook; returns a switch that lets this module's own calls through."""
    root = os.path.realpath(root)
    allowed = [False]

    def hook(event: str, args: tuple) -> None:
        if allowed[0]:
            return
        if event in BLOCKED_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and _writes(args) and not _inside(root, args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} (outside the sandbox dir)")
        if event in PATH_EVENTS and not all(_inside(root, a) for a in _paths(args)):
            raise PermissionError(f"sandbox: {event} outside the sandbox dir")

    sys.addaudithook(hook)
    return lambda on: allowed.__setitem__(0, on)


def _writes(args: tuple) -> bool:
    path, mode, flags = (tuple(args) + (None, None, 0))[:3]
    if isinstance(path, int):
        return False  # an fd opened already
    return bool((flags or 0) & WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")


def _paths(args: tuple) -> list[Any]:
    return [a for a in args if isinstance(a, str | bytes | os.PathLike)]


def _inside(root: str, path: Any) -> bool:
    if isinstance(path, int):
        return True
    full = os.path.realpath(os.fsdecode(path))
    return full == root or full.startswith(root + os.sep) or full == os.devnull


def run_program(spec: dict[str, Any]) -> None:
    """``exec``: run the program file as ``__main__``; exit 1 on an uncaught exception."""
    import runpy
    import traceback

    confine(spec["limits"], spec["parent_pid"])
    sys.argv = [spec["program"]]
    try:
        runpy.run_path(spec["program"], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - the program's failure is its exit code
        traceback.print_exc()
        sys.exit(1)


def serve(spec: dict[str, Any]) -> None:
    """``serve``: load the user function, say ready, then answer one call per input line."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    loop = _new_loop()  # before the hook: an event loop makes a socketpair
    isolated, allow = confine(spec["limits"], spec["parent_pid"])
    try:
        scorer = _load(spec["user"])
    except Exception as exc:  # noqa: BLE001 - any load failure is reported to the parent
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    ready = {"ready": True, "network_isolated": isolated, "pid": os.getpid(), **_about(scorer)}
    replies.write(json.dumps(ready) + "\n")
    for line in sys.stdin.buffer:
        _set_cpu_budget(float(spec["limits"]["cpu_s"]), allow)
        replies.write(json.dumps({"results": _score(scorer, loop, line)}) + "\n")


def _new_loop() -> Any:
    import asyncio

    return asyncio.new_event_loop()


def _load(user: dict[str, Any]) -> Any:
    from types import SimpleNamespace

    from rlfleet.reward.scorers.user import user_scorer

    return user_scorer(SimpleNamespace(**user))


def _about(scorer: Any) -> dict[str, Any]:
    keys = ("batched", "is_async", "takes_prompt", "description")
    return {key: getattr(scorer, key) for key in keys}


def _set_cpu_budget(cpu_s: float, allow: Callable[[bool], None]) -> None:
    """CPU accumulates over a worker's life: each call gets ``cpu_s`` more than used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + cpu_s + 0.999)
    allow(True)
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
    finally:
        allow(False)


def _score(scorer: Any, loop: Any, line: bytes) -> list[dict[str, Any]]:
    from rlfleet.reward.types import ScoreRequest

    requests = [ScoreRequest.from_dict(item) for item in json.loads(line)["requests"]]
    if scorer.is_async:
        results = loop.run_until_complete(scorer.ascore_many(requests))
    else:
        results = scorer.score_many(requests)
    return [result.to_dict() for result in results]


def main(argv: list[str]) -> None:
    mode, spec = argv[0], json.loads(argv[1])
    {"exec": run_program, "serve": serve}[mode](spec)


if __name__ == "__main__":
    main(sys.argv[1:])
