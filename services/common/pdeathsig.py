"""Tie a child process's life to the thread that starts it (Linux ``PR_SET_PDEATHSIG``).

Why: a parent killed outright (SIGKILL, a CI timeout, a Ray worker torn down) must not leave
its children (an embedded Redis, a role process) running. The kernel delivers the chosen signal
to the child when the *thread* that forked it exits, so start children from a long-lived
thread, normally the main one.

How: util-linux ``setpriv --pdeathsig SIG --`` in front of the command sets it and execs the
command (same pid), so no Python runs in the child between fork and exec, and ``subprocess``
can use ``vfork``. The alternative, a ``preexec_fn`` calling ``prctl``, forces a plain
``fork()`` of the whole threaded parent and runs Python in the child; under load such a child
crashed with SIGSEGV before exec (CI saw an embedded Redis "exited with code -11" at a restart
from a gRPC-running test process, twice in a row). The ``preexec_fn`` is only the fallback where
``setpriv`` is missing.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
"""Looked up once, in the parent: a ``dlopen``/``dlsym`` between fork and exec can meet a lock
another thread held at the fork."""


def die_with_parent(
    sig: signal.Signals = signal.SIGTERM,
) -> tuple[list[str], Callable[[], None] | None]:
    """A command prefix and a ``preexec_fn`` for ``subprocess.Popen`` that make the child get
    ``sig`` when the starting thread exits; ``([], None)`` off Linux."""
    prctl = _prctl  # None off Linux
    if prctl is None:
        return [], None
    setpriv = shutil.which("setpriv")
    if setpriv:
        return [setpriv, "--pdeathsig", sig.name.removeprefix("SIG"), "--"], None
    return [], lambda: prctl(PR_SET_PDEATHSIG, sig)
