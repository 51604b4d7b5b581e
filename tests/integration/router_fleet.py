"""A router and rollout replicas as real processes, for the tests that call them over gRPC.

``launch_fleet`` starts a router on a fresh cluster name (so tests sharing one Redis never see
each other's replicas); ``add_replica`` adds an hf replica on the tiny model; ``teardown``
SIGKILLs the replicas and stops the router, each by its own PID. Shared by ``test_router`` and
``test_router_weight_sync``.
"""

from __future__ import annotations

import signal
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from procs import ServiceProcess, start_and_wait
from replica_proc import ReplicaProc, start_replica, stop_replica

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis, free_port

REPLICA_ARGS = ("rollout.backend=hf", "rollout.heartbeat_ttl_s=2")


@dataclass
class Fleet:
    """One router on a cluster of its own, and the replicas added to it."""

    keys: Keys
    redis_url: str
    router: ServiceProcess
    address: str
    log_dir: Path
    replicas: dict[str, ReplicaProc] = field(default_factory=dict)


def start_router(redis_url: str, keys: Keys, log_path: Path) -> tuple[ServiceProcess, str]:
    """Launch ``python -m rlfleet.rollout.router.main`` and wait until it says it is ready."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "rlfleet.rollout.router.main",
        "--port",
        str(port),
        f"redis_url={redis_url}",
        f"cluster={keys.cluster}",
        "router.janitor_interval_s=0.3",
    ]
    router = start_and_wait(command, log_path, lambda p: p.wait_for_line("router ready", 60))
    return router, f"127.0.0.1:{port}"


def launch_fleet(redis_server: EmbeddedRedis, log_dir: Path) -> Fleet:
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    router, address = start_router(redis_server.url, keys, log_dir / "router.log")
    return Fleet(keys, redis_server.url, router, address, log_dir)


def add_replica(fleet: Fleet, replica_id: str, *extra: str) -> ReplicaProc:
    log_path = fleet.log_dir / f"{replica_id}.log"
    replica = start_replica(
        fleet.redis_url, fleet.keys, replica_id, log_path, *REPLICA_ARGS, *extra
    )
    fleet.replicas[replica_id] = replica
    return replica


def teardown(fleet: Fleet) -> None:
    for replica in fleet.replicas.values():
        stop_replica(replica, signal.SIGKILL)
    fleet.router.stop()
