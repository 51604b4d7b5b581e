"""The audit hook (PEP 578) every sandboxed child installs before user code runs.

Why a hook on top of the kernel's limits (``isolation``, ``mounts``): it gives ordinary Python
code a clear error at the line that tried ("sandbox: os.fork is not allowed") and it holds on
machines where the kernel layer falls back. It refuses new processes, sockets, signals to
others, ``ctypes`` libraries and rlimit changes, and writes, renames, deletions and ``sqlite3``
databases outside the sandbox directory. It is defence in depth, not a boundary: native code
(``_posixsubprocess``, a C extension) raises no event, and there the kernel is what binds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

BLOCKED_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "pty.spawn",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "socket.__new__",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.getaddrinfo",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.cdata",
        "resource.setrlimit",
        "resource.prlimit",
        "os.setuid",
        "os.setgid",
        "sys.remote_exec",
    }
)
PATH_EVENTS = frozenset(
    {
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.symlink",
        "os.link",
        "os.rename",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
        "sqlite3.connect",
    }
)
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


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
