"""A replica's generated id, for one started without ``--replica-id`` or ``rollout.replica_id``,
and the config that carries it.

Apart from ``main`` (the command line resolves it before the config is recorded) and ``app``
(a replica served in-process without one), so both use it without importing each other.
"""

from __future__ import annotations

import socket
import uuid

from rlfleet.common.config import RlfleetConfig


def default_replica_id() -> str:
    """Host name plus a random suffix; ':' and spaces are not allowed in Redis key parts."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"rollout-{host}-{uuid.uuid4().hex[:6]}"


def with_replica_id(config: RlfleetConfig) -> RlfleetConfig:
    """``config`` with its replica id resolved (generated when neither ``--replica-id`` nor
    ``rollout.replica_id`` gave one) before it is recorded: each replica started without an
    id writes a config file of its own (``config.rollout-<host>-<suffix>.yaml``), not one
    ``config.rollout.yaml`` they all overwrite."""
    if config.rollout.replica_id:
        return config
    rollout = config.rollout.model_copy(update={"replica_id": default_replica_id()})
    return config.model_copy(update={"rollout": rollout})
