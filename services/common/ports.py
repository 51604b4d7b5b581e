"""Free TCP ports for processes that are told their port before they bind it.

Why: a launcher picks a port, tells the rest of the fleet, and the role binds it seconds later
(after importing torch). A port the kernel hands out for ``bind(0)`` lies in the ephemeral
range, the range it also takes the local end of every outgoing connection from; in that gap an
outgoing connection of any process (a Ray worker, a Redis client) may take the port and hold
it, and the role then fails to bind on every restart. CI saw exactly that: the trainer under
Ray failed four restarts in a row on one port. So ports are drawn below the ephemeral range,
where the kernel never assigns one on its own, and above Ray's worker ports (10002-19999); and
every pick is remembered for a while in a file shared by the host's processes, so that two
launchers on one host (parallel tests) do not draw the same port before either binds it.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import time
from pathlib import Path

RESERVED_PORT = 6379
"""The conventional Redis port: a server someone else runs may be there."""
WINDOW_LOW = 20000
"""Above Ray's default worker ports (10002-19999) and the usual fixed service ports."""
DEFAULT_EPHEMERAL_LOW = 32768
"""Linux's default start of the ephemeral range, used where /proc does not say."""
HOLD_S = 300.0
"""How long a picked port stays reserved for the process that picked it."""
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def is_free(port: int) -> bool:
    """Nobody is bound to ``port`` on any IPv4 address (a wildcard bind fails if anyone is)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nobody listens on now, outside the ephemeral range, not picked on this host in
    the last ``HOLD_S`` seconds (never 6379)."""
    high = ephemeral_low()
    if high - WINDOW_LOW < 1000:  # an unusual ephemeral range: let the kernel choose
        return _kernel_port()
    with _reservations() as held:
        for _ in range(200):
            port = random.randrange(WINDOW_LOW, high)
            if port not in held and port != RESERVED_PORT and is_free(port):
                held[port] = time.time()
                return port
    return _kernel_port()


def _kernel_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port != RESERVED_PORT:
            return port


def _reservation_file() -> Path:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"rlfleet-ports-{uid}"


@contextlib.contextmanager
def _reservations():
    """The host's recent picks, ``{port: time}``, under an exclusive lock; written back after.
    Without ``fcntl`` (not POSIX) the picks are only random, not reserved."""
    try:
        import fcntl
    except ImportError:
        yield {}
        return
    path = _reservation_file()
    with open(path, "a+", encoding="ascii") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        held = _recent(handle.read(), time.time() - HOLD_S)
        yield held
        handle.seek(0)
        handle.truncate()
        handle.write("".join(f"{port} {at:.0f}\n" for port, at in held.items()))


def _recent(text: str, since: float) -> dict[int, float]:
    held: dict[int, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            with contextlib.suppress(ValueError):
                if float(parts[1]) >= since:
                    held[int(parts[0])] = float(parts[1])
    return held
