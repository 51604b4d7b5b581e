"""Admission control: a bounded queue per replica, shared by every router.

Why: without a bound, a burst from outside callers (the OpenAI front, many clients) piles up in
the replicas' streams, every caller waits longer and longer, and memory grows until something
breaks. With ``router.max_queue_per_replica`` set, a replica whose queue is full takes no new
work, and when every replica that could serve a request is full the router refuses it at once
with ``ResourceExhausted`` (gRPC RESOURCE_EXHAUSTED, HTTP 429): the caller backs off and retries,
and nothing already accepted is slowed down.

A replica's queue is what the routers share in Redis as its in-flight count: requests routed to
it and not answered yet, waiting in its stream or running. Every router reads the same counts
(reconciled with the streams every few seconds), so the bound holds fleet-wide, give or take
the requests routers admit in the same instant. Pure functions, no I/O.
"""

from __future__ import annotations

import dataclasses

from rlfleet.common.errors import ResourceExhausted
from rlfleet.rollout.registry import RegistrySnapshot
from rlfleet.rollout.router.routing import eligible


def admit(
    snap: RegistrySnapshot, min_version: int, limit: int | None, count: int = 1
) -> RegistrySnapshot:
    """The snapshot routing may choose from: replicas whose queue holds ``limit`` requests
    leave it (as a drained replica does). Raises ``ResourceExhausted`` when the eligible
    replicas together have room for fewer than ``count`` requests. No limit, or no eligible
    replica at all (routing then says why, as ``Unavailable``), changes nothing."""
    if not limit:
        return snap
    pool = eligible(snap.replicas, min_version, snap.draining)
    if not pool:
        return snap
    queued = {r.replica_id: max(0, snap.inflight.get(r.replica_id, 0)) for r in pool}
    room = sum(max(0, limit - n) for n in queued.values())
    if room < count:
        raise ResourceExhausted(_full_message(queued, limit, count))
    full = {rid for rid, n in queued.items() if n >= limit}
    return dataclasses.replace(snap, draining=snap.draining | full) if full else snap


def _full_message(queued: dict[str, int], limit: int, count: int) -> str:
    asked = f"{count} requests" if count > 1 else "a request"
    return (
        f"every replica's queue is full: no room for {asked} ({len(queued)} replicas hold "
        f"{sum(queued.values())} requests, router.max_queue_per_replica={limit}); "
        "retry later"
    )
