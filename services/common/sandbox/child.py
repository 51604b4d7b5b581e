"""The child side of the sandbox: isolate and confine this process, then run a program or serve.

Started by ``rlfleet.common.sandbox.parent`` as ``python -I -m rlfleet.common.sandbox.child
MODE SPEC_JSON`` in its own session, with a scrubbed environment and an empty temporary
directory as its working directory. Only the standard library and this package are imported
before the confinement is in place, so user code never runs unconfined. The layers:

- kernel, set up first (``isolation``, ``mounts``): a pids cgroup, pid/mount/network/IPC/UTS
  namespaces, a read-only filesystem but the sandbox directory, a /proc of its own, no
  capabilities, death with the parent; then rlimits (CPU, address space, file size, process
  count, no core files);
- a Python audit hook (``guard``), everywhere: clear errors for ordinary code, and the only
  layer where the kernel's is not available.

Modes: ``exec`` runs a program file (the ``code`` scorer, sandboxed tools); ``serve`` loads a
handler (``spec["handler"]``, a module with ``load(payload, loop) -> (about, answer)``: the
reward role's ``sandbox_serve``) and answers calls, one JSON line in and one out, on a private
copy of stdout (fd 1 itself goes to /dev/null, so the user's prints cannot corrupt replies);
after each call every other process in its pid namespace is killed. ``probe`` prints what
``isolation`` achieved, as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any

from rlfleet.common.sandbox.guard import install_guard
from rlfleet.common.sandbox.isolation import Isolation, isolate, kill_leftovers, reap_children

MIB = 1 << 20


def confine(limits: dict[str, Any]) -> Callable[[bool], None]:
    """rlimits and the audit hook on this process; returns the hook's switch for this
    module's own rlimit changes and kills."""
    set_limits(limits)
    sys.dont_write_bytecode = True
    return install_guard(os.getcwd())


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


def run_program(spec: dict[str, Any], _: Isolation) -> None:
    """``exec``: run the program file as ``__main__``; exit 1 on an uncaught exception."""
    import runpy
    import traceback

    confine(spec["limits"])
    sys.argv = [spec["program"]]
    try:
        runpy.run_path(spec["program"], run_name="__main__")
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - the program's failure is its exit code
        traceback.print_exc()
        sys.exit(1)


def serve(spec: dict[str, Any], isolation: Isolation) -> None:
    """``serve``: load the handler, say ready, then answer one call per input line."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    loop = _new_loop()  # before the hook: an event loop makes a socketpair
    allow = confine(spec["limits"])
    try:
        about, answer = importlib.import_module(spec["handler"]).load(spec["payload"], loop)
    except Exception as exc:  # noqa: BLE001 - any load failure is reported to the parent
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    ready = {
        "ready": True,
        "network_isolated": "net" in isolation.namespaces,
        "isolation": isolation.as_dict(),
        "pid": os.getpid(),
        **about,
    }
    replies.write(json.dumps(ready) + "\n")
    own_pids = "pid" in isolation.namespaces
    for line in sys.stdin.buffer:
        _set_cpu_budget(float(spec["limits"]["cpu_s"]), allow)
        _privileged(allow, reap_children)  # what the service killed after the last call
        reply = answer(json.loads(line))
        if own_pids:
            _privileged(allow, kill_leftovers)  # nothing a call started outlives it
        replies.write(json.dumps(reply) + "\n")


def probe(_: dict[str, Any], isolation: Isolation) -> None:
    """``probe``: what the kernel enforces here, for the service's log line and the tests."""
    print(json.dumps(isolation.as_dict()))


def _new_loop() -> Any:
    import asyncio

    return asyncio.new_event_loop()


def _set_cpu_budget(cpu_s: float, allow: Callable[[bool], None]) -> None:
    """CPU accumulates over a worker's life: each call gets ``cpu_s`` more than used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + cpu_s + 0.999)
    _privileged(
        allow, lambda: resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
    )


def _privileged(allow: Callable[[bool], None], action: Callable[[], Any]) -> None:
    """Run one of this module's own guarded calls with the audit hook switched off."""
    allow(True)
    try:
        action()
    finally:
        allow(False)


MODES = {"exec": run_program, "serve": serve, "probe": probe}


def main(argv: list[str]) -> None:
    mode, spec = argv[0], json.loads(argv[1])
    MODES[mode](spec, isolate(spec))


if __name__ == "__main__":
    main(sys.argv[1:])
