"""Which replica should serve a request? Pure choice logic, no I/O.

Why sticky with a load cap: one GRPO group (or one conversation) shares a prompt, so sending
it to the same replica reuses that replica's prefix cache; but a session must not pin work to a
replica that is dead, behind on weights, being drained, or already overloaded (peers' routers
kept sending to dead workers because of cache affinity). Otherwise we pick the replica with
the fewest requests in flight; ties are broken at random so that sequential sessions, which
all see zero load, still spread over the fleet.

The router applies this rule in two places: here, in Python (batches, the janitor), and inside
the one-step enqueue Lua (``enqueue.py``, single requests, against live counts). Why two: a
batch is placed from one snapshot with no Redis call per request, and a single request is
placed in the same Lua step that queues it, so neither can call the other. The Lua is the
rule; this copy is pinned to it: both break ties with one random number the same way
(``tie_break``), and ``tests/integration/test_routing_lua_parity.py`` runs the two on the same
generated fleets and requires the same picks, for one request and for a batch against the
same requests one by one. One part is the Lua's alone: a session with no usable pin goes to
the replica with the fewest active sessions (``enqueue.py`` says why); a batch places its
sessions as they come, by load.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping

from rlfleet.common.errors import Unavailable
from rlfleet.rollout.registry import ReplicaInfo
from rlfleet.rollout.types import ReplicaState

SERVING = ReplicaState.SERVING
STARTUP_GRACE_S = 600.0  # how long a replica may stay silent while its engine loads


def loading(replica: ReplicaInfo) -> bool:
    """Registered as starting lately: its engine may still be loading (and not heartbeating),
    so a missing heartbeat does not mean it died."""
    return replica.state == ReplicaState.STARTING and 0 <= replica.heartbeat_age_s < STARTUP_GRACE_S


def eligible(
    candidates: list[ReplicaInfo], min_version: int, draining: Collection[str] = ()
) -> list[ReplicaInfo]:
    """Replicas that may take a new request right now."""
    return [
        r
        for r in candidates
        if r.alive
        and r.state == SERVING
        and r.weight_version >= min_version
        and r.replica_id not in draining
    ]


def why_none(candidates: list[ReplicaInfo], min_version: int, draining: Collection[str]) -> str:
    """A message naming the first filter that left no replica, so operators know what to fix."""
    if not candidates:
        return "no rollout replica is registered"
    alive = [r for r in candidates if r.alive]
    if not alive:
        return f"none of {len(candidates)} registered replicas is alive (heartbeats expired)"
    serving = [r for r in alive if r.state == SERVING]
    if not serving:
        states = sorted({r.state for r in alive})
        return f"no live replica is serving (states: {', '.join(states)})"
    current = [r for r in serving if r.weight_version >= min_version]
    if not current:
        newest = max(r.weight_version for r in serving)
        return f"no serving replica has weight version >= {min_version} (newest is {newest})"
    return f"all {len(current)} replicas at version >= {min_version} are being drained"


class RoundRobin:
    """``router.policy: round_robin``: each pick takes the next eligible replica (by id),
    whatever its load or the request's session. Per router process."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self, candidates: list[ReplicaInfo], min_version: int, draining: Collection[str] = ()
    ) -> str:
        pool = sorted(r.replica_id for r in eligible(candidates, min_version, draining))
        if not pool:
            raise Unavailable(why_none(candidates, min_version, draining))
        self._turn += 1
        return pool[(self._turn - 1) % len(pool)]


def pick_replica(
    candidates: list[ReplicaInfo],
    inflight: Mapping[str, int],
    sticky_id: str | None,
    min_version: int,
    max_inflight: int,
    draining: Collection[str] = (),
    rng: random.Random | None = None,
) -> str:
    """The id of the replica to use; raises Unavailable (saying why) when none is eligible.

    The sticky replica is kept while it is eligible and has fewer than ``max_inflight``
    requests in flight; otherwise the least-loaded eligible replica wins.
    """
    pool = eligible(candidates, min_version, draining)
    if not pool:
        raise Unavailable(why_none(candidates, min_version, draining))
    load = {r.replica_id: max(0, inflight.get(r.replica_id, 0)) for r in pool}
    if sticky_id in load and load[sticky_id] < max_inflight:
        return sticky_id
    fewest = min(load.values())
    tied = sorted(rid for rid, n in load.items() if n == fewest)
    return tie_break(tied, (rng or random).random())


def tie_break(tied: list[str], coin: float) -> str:
    """The one of ``tied`` (sorted) that ``coin`` in [0, 1) picks: as the enqueue Lua does
    (``tied[min(#tied, floor(coin * #tied) + 1)]``), so both pick alike for one coin."""
    return tied[min(len(tied) - 1, int(coin * len(tied)))]
