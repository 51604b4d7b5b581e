"""A router and rollout replicas as real processes, for the tests that call them over gRPC.

``launch_fleet`` starts a router on a fresh cluster name (so tests sharing one Redis never see
each other's replicas) and the replicas named; ``add_replica`` adds an hf replica on the tiny
model; ``teardown`` SIGKILLs the replicas and stops the router, each by its own PID. Shared by
the router, batch, env, weight-update and Redis-restart tests.
"""

from __future__ import annotations

import signal
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from procs import ServiceProcess
from replica_proc import ReplicaProc, start_replica, stop_replica
from router_proc import start_router

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis

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


def launch_fleet(
    redis_server: EmbeddedRedis, log_dir: Path, replica_ids: Sequence[str] = (), *extra: str
) -> Fleet:
    """A router on a cluster of its own and ``replica_ids`` (each with ``extra`` overrides);
    stopped by ``teardown``."""
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    router, address = start_router(redis_server.url, keys, log_dir / "router.log")
    fleet = Fleet(keys, redis_server.url, router, address, log_dir)
    try:
        for replica_id in replica_ids:
            add_replica(fleet, replica_id, *extra)
    except BaseException:
        teardown(fleet)
        raise
    return fleet


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
