"""A replica's generated id, for one started without ``--replica-id`` or ``rollout.replica_id``.

Apart from ``main`` (the command line resolves it before the config is recorded) and ``app``
(a replica served in-process without one), so both use it without importing each other.
"""

from __future__ import annotations

import socket
import uuid


def default_replica_id() -> str:
    """Host name plus a random suffix; ':' and spaces are not allowed in Redis key parts."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"rollout-{host}-{uuid.uuid4().hex[:6]}"
