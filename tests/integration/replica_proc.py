"""Start, find and stop real rollout replica processes for integration tests.

A replica is launched as ``python -m rlfleet.rollout.main`` with ``--port 0``; its address is
read back from the Redis registry once it reports ``serving``. Starting and stopping go through
the shared ``procs.ServiceProcess`` (its own process group, stopped by its own PID/group only).
"""

from __future__ import annotations

import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from procs import ROOT, ServiceProcess

from rlfleet.common.keys import Keys

MODEL = ROOT / "models" / "tiny-qwen2-arith"


@dataclass
class ReplicaProc:
    """A replica subprocess we started, and where to reach it."""

    proc: ServiceProcess
    replica_id: str
    keys: Keys
    redis_url: str
    address: str = ""
    log_path: Path | None = None

    def log_tail(self) -> str:
        return self.proc.log_tail()


def start_replica(
    redis_url: str, keys: Keys, replica_id: str, log_path: Path, *extra: str
) -> ReplicaProc:
    """Launch the replica and wait until the registry says it serves (address included)."""
    command = [
        sys.executable,
        "-m",
        "rlfleet.rollout.main",
        "--replica-id",
        replica_id,
        "--port",
        "0",
        f"redis_url={redis_url}",
        f"cluster={keys.cluster}",
        f"model.path={MODEL}",
        "rollout.heartbeat_interval_s=0.5",
        *extra,
    ]
    proc = ServiceProcess.start(command, log_path, name=f"replica {replica_id}")
    replica = ReplicaProc(proc, replica_id, keys, redis_url, log_path=log_path)
    try:
        replica.address = wait_serving(replica, timeout_s=240)
    except BaseException:
        stop_replica(replica, signal.SIGKILL)
        raise
    return replica


@contextmanager
def replicas_started(
    redis_url: str, keys: Keys, names: Sequence[str], logs: Path, sig: int = signal.SIGTERM
) -> Iterator[list[ReplicaProc]]:
    """Replicas ``names`` (each logging to ``logs/<name>.log``), stopped with ``sig`` (by
    PID) when the block ends, whatever happened."""
    started: list[ReplicaProc] = []
    try:
        for name in names:
            started.append(start_replica(redis_url, keys, name, logs / f"{name}.log"))
        yield started
    finally:
        for replica in started:
            stop_replica(replica, sig)


def wait_serving(replica: ReplicaProc, timeout_s: float) -> str:
    """The replica's address, once its registry entry says ``serving``."""
    client = redis.Redis.from_url(replica.redis_url)

    def serving_address() -> str:
        entry = client.hgetall(replica.keys.replica(replica.replica_id))
        return entry[b"address"].decode() if entry.get(b"state") == b"serving" else ""

    try:
        return replica.proc.wait_until(serving_address, timeout_s, "serving")
    finally:
        client.close()


def stop_replica(replica: ReplicaProc, sig: int = signal.SIGTERM) -> None:
    """Stop our own child by its PID (SIGKILL if it lingers), then any engine processes it
    left behind in its process group (vLLM's engine core outlives a SIGKILLed parent)."""
    replica.proc.stop(sig, grace_s=30)


def replica_for_module(
    redis_url: str, tmp_path_factory: pytest.TempPathFactory, replica_id: str, *extra: str
) -> Iterator[ReplicaProc]:
    """A module fixture's body (``yield from``): one replica under a cluster name of its own,
    its log in a fresh folder, stopped after the module and required to have exited cleanly."""
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    log_path = tmp_path_factory.mktemp(replica_id) / "replica.log"
    replica = start_replica(redis_url, keys, replica_id, log_path, *extra)
    yield replica
    stop_replica(replica)
    assert replica.proc.returncode == 0, replica.log_tail()
