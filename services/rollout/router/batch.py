"""What the router needs to answer a whole batch with a few Redis round trips, not ~10 a request.

Why: one training step is dozens of prompts. Routed one by one, each costs a result lookup, a
registry snapshot, a claim, a submit, a wait and a release (~10 round trips, ~370 a step), and
the replica sees them trickle in, so its engine batches them badly. Here a batch is routed from
ONE snapshot (``assign``: the same choice as ``routing.pick_replica``, with the in-memory counts
and sticky map updated as requests are placed), each replica gets ONE queue entry holding its
share, and the router waits for all entries together (``wait_entries``, the work queue's
``wait_all``: one MGET per wake-up, one BLPOP on every pending entry's notify key). The replica
stores each member's answer under the member's own request id (so a retried request is
answered once, by either RPC) and then completes the entry; the entry's own answer is only
"done" or the failure of the entry as a whole (unreadable, dead-lettered), which then stands
for every member.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlfleet.common.queue.answers import Answers
from rlfleet.common.queue.results import Result
from rlfleet.rollout.registry import RegistrySnapshot
from rlfleet.rollout.router.routing import RoundRobin, pick_replica
from rlfleet.rollout.types import GenerateRequest

WAKE_POLL_S = 1.0
"""Longest BLPOP between result checks. Entry ids are this batch's own, so no other waiter
takes their wake-up tokens; the re-check only guards against a token that expired."""


@dataclass
class Assignment:
    """Where each request of a batch goes: replica id -> its requests, in batch order, and
    each session's replica (pinned with a fresh TTL)."""

    groups: dict[str, list[GenerateRequest]] = field(default_factory=dict)
    pins: dict[str, str] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {replica_id: len(group) for replica_id, group in self.groups.items()}


def assign(
    requests: Sequence[GenerateRequest],
    snap: RegistrySnapshot,
    max_inflight: int,
    rng: random.Random,
    round_robin: RoundRobin | None = None,
) -> Assignment:
    """Route every request from one snapshot; raises Unavailable (saying why) when one of them
    has no eligible replica. Counts and stickies are updated as requests are placed, so the
    batch spreads like the same requests sent one after another."""
    inflight, sticky = dict(snap.inflight), dict(snap.stickies)
    plan = Assignment()
    for request in requests:
        session = request.session_id
        args = (inflight, sticky.get(session), request.min_weight_version, max_inflight)
        replica_id = (
            round_robin.pick(snap.replicas, request.min_weight_version, snap.draining)
            if round_robin
            else pick_replica(snap.replicas, *args, snap.draining, rng)
        )
        plan.groups.setdefault(replica_id, []).append(request)
        inflight[replica_id] = inflight.get(replica_id, 0) + 1
        if session:  # pinned, or its pin refreshed, as a single request's claim does
            sticky[session] = plan.pins[session] = replica_id
    return plan


async def wait_entries(
    answers: Answers,
    entry_ids: Sequence[str],
    deadline: float,
    on_timeout: Callable[[list[str]], Exception],
    epoch: str | None = None,
) -> dict[str, Result]:
    """Every entry's answer (``Answers.wait_all``: one MGET, then one BLPOP on the notify keys
    of those still pending, per wake-up); ``on_timeout(pending ids)`` is raised at the deadline,
    ``Vanished`` when the server lost its data since ``epoch`` (read before submitting)."""
    done = await answers.wait_all(list(entry_ids), deadline, WAKE_POLL_S, epoch)
    if pending := [eid for eid in entry_ids if eid not in done]:
        raise on_timeout(pending)
    return done
