"""``run_dir/endpoints.json``: the addresses every process of a run actually bound.

Why a file: ports may be picked at start (``port=0``, ``rlfleet up``'s free ports), and tools
(``rlfleet score``, a notebook, a scraper) need to find them without reading logs. Each process
that starts services merges its own entry, ``{role: {name: address}}``, under an exclusive
``flock`` and replaces the file atomically, so concurrent writers never lose each other's entries
and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

FILE_NAME = "endpoints.json"


def endpoints_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / FILE_NAME


def read_endpoints(run_dir: str | os.PathLike[str]) -> dict[str, dict[str, str]]:
    """Everything recorded so far ({} when nothing is)."""
    path = endpoints_path(run_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def write_endpoints(
    run_dir: str | os.PathLike[str], role: str, addresses: Mapping[str, str]
) -> Path:
    """Record ``role``'s addresses (replacing that role's previous entry); returns the file."""
    path = endpoints_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        merged = {**read_endpoints(run_dir), role: dict(addresses)}
        partial = path.with_name(f".{FILE_NAME}.{os.getpid()}")
        partial.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
        partial.replace(path)
    return path


def describe(role: str, addresses: Mapping[str, str]) -> str:
    """One line for the log and the terminal: ``reward: grpc=127.0.0.1:50061 http=...``."""
    return f"{role}: " + " ".join(f"{name}={addr}" for name, addr in addresses.items())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_name(f".{FILE_NAME}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
