"""Start, find and stop real rollout replica processes for integration tests.

A replica is launched as ``python -m rlfleet.rollout.main`` with ``--port 0``; its address is
read back from the Redis registry once it reports ``serving``. Tests stop only the processes
they started, by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from rlfleet.common.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-qwen2-arith"


@dataclass
class ReplicaProc:
    """A replica subprocess we started, and where to reach it."""

    proc: subprocess.Popen
    replica_id: str
    keys: Keys
    redis_url: str
    address: str = ""
    log_path: Path | None = None

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])


def start_replica(
    redis_url: str, keys: Keys, replica_id: str, log_path: Path, *extra: str
) -> ReplicaProc:
    """Launch the replica and wait until the registry says it serves (address included)."""
    command = [sys.executable, "-m", "rlfleet.rollout.main", "--replica-id", replica_id,
               "--port", "0", f"redis_url={redis_url}", f"cluster={keys.cluster}",
               f"model.path={MODEL}", "rollout.heartbeat_interval_s=0.5", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )  # its own group: engine children too
    replica = ReplicaProc(proc, replica_id, keys, redis_url, log_path=log_path)
    try:
        replica.address = wait_serving(replica, timeout_s=240)
    except BaseException:
        stop_replica(replica)
        raise
    return replica


def wait_serving(replica: ReplicaProc, timeout_s: float) -> str:
    client = redis.Redis.from_url(replica.redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if replica.proc.poll() is not None:
                raise RuntimeError(f"replica exited early:\n{replica.log_tail()}")
            entry = client.hgetall(replica.keys.replica(replica.replica_id))
            if entry.get(b"state") == b"serving":
                return entry[b"address"].decode()
            time.sleep(0.2)
    finally:
        client.close()
    raise TimeoutError(f"replica not serving after {timeout_s}s:\n{replica.log_tail()}")


def stop_replica(replica: ReplicaProc, sig: int = signal.SIGTERM) -> None:
    """Stop our own child by its PID (SIGKILL if it lingers), then any engine processes it
    left behind in its process group (vLLM's engine core outlives a SIGKILLed parent)."""
    if replica.proc.poll() is None:
        replica.proc.send_signal(sig)
        try:
            replica.proc.wait(30)
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait()
    deadline = time.monotonic() + 10
    while _group_alive(replica.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _group_alive(replica.proc.pid):
        os.killpg(replica.proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
