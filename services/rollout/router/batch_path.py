"""One routed GenerateBatch: every request placed from one registry snapshot, one queue entry
per replica, all entries awaited together, the in-flight counts released at the end.

Why: a training step is dozens of prompts, and routed one by one each costs its own round
trips while the replica sees them trickle in. The helpers (``batch.py``: ``assign``,
``wait_entries``) keep it to a few round trips a step, and each replica
runs its share as one engine batch. Idempotent per request id, like a single Generate: ids
already answered are served from their stored answers and not queued again. That is also how a
batch survives an empty Redis restart: the wait notices the new data epoch (``Vanished``), and
the members without a stored answer are routed and queued again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import Counter
from collections.abc import Callable, Sequence

from rlfleet.common.config import RouterConfig
from rlfleet.common.errors import InvalidArgument, Unavailable
from rlfleet.common.queue.answers import Answers, Vanished
from rlfleet.common.queue.results import Result
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.rollout.registry import ReplicaRegistry
from rlfleet.rollout.router.admission import admit
from rlfleet.rollout.router.batch import Assignment, assign, wait_entries
from rlfleet.rollout.router.outage import route_give_up
from rlfleet.rollout.router.outcomes import Outcome, missing, outcome, raise_or_return
from rlfleet.rollout.router.request_path import ROUTE_POLL_S
from rlfleet.rollout.router.routing import RoundRobin
from rlfleet.rollout.types import GenerateRequest, GenerateResult, pack_requests

log = logging.getLogger(__name__)


class BatchPath:
    """Answers a batch of requests, in order; the first failure in order fails the call."""

    def __init__(
        self,
        cfg: RouterConfig,
        registry: ReplicaRegistry,
        rng: random.Random,
        round_robin: RoundRobin | None,
        queue: Callable[[str], WorkQueue],
        answers: Answers,
    ) -> None:
        self._cfg, self.registry, self._rng, self._round_robin = cfg, registry, rng, round_robin
        self._queue, self._answers = queue, answers  # a replica's queue; every request's answer
        self._route_wait_s = cfg.route_wait_s

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Answers for ``requests``, in order (stored ones first looked up in one MGET)."""
        _validate_batch(requests)
        timeout_s = max((r.timeout_s for r in requests), default=0) or self._cfg.request_timeout_s
        outcomes = await self._answer(requests, asyncio.get_running_loop().time() + timeout_s)
        return [raise_or_return(outcomes[r.request_id]) for r in requests]

    async def _answer(
        self, requests: Sequence[GenerateRequest], deadline: float
    ) -> dict[str, Outcome]:
        """Stored answers first (one MGET), the rest run as a batch; run again for those
        without an answer if the server lost the batch (an empty restart)."""
        ids = [r.request_id for r in requests]
        stored = await self._answers.get_results(ids)
        outcomes = {rid: outcome(rid, result) for rid, result in stored.items()}
        if todo := [r for r in requests if r.request_id not in stored]:
            try:
                outcomes |= await self._run_batch(todo, deadline)
            except Vanished:
                log.warning("Redis lost a batch of %d (restarted empty?): queued again", len(todo))
                outcomes |= await self._answer(todo, deadline)
        return outcomes

    async def _run_batch(
        self, requests: list[GenerateRequest], deadline: float
    ) -> dict[str, Outcome]:
        """Route, claim, queue one entry per replica, wait for them all, release."""
        epoch = await self._answers.epoch()  # before queueing: a later loss is then seen
        plan = await self._route_batch(requests, deadline)
        entries = {f"batch-{uuid.uuid4().hex}-{rid}": rid for rid in plan.groups}
        served = plan.counts  # released as routed unless answers say who served
        try:
            await asyncio.gather(
                *(
                    self._queue(rid).submit(eid, pack_requests(plan.groups[rid]))
                    for eid, rid in entries.items()
                )
            )
            done = await wait_entries(
                self._answers,
                list(entries),
                deadline,
                lambda pending: _batch_timeout(pending, entries),
                epoch,
            )
            outcomes, served = await self._collect(entries, plan, done, epoch)
            return outcomes
        finally:
            await self.registry.release_many(served)

    async def _route_batch(self, requests: list[GenerateRequest], deadline: float) -> Assignment:
        """Place every request from one snapshot (waiting briefly, like a single request); claim."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self._route_wait_s)
        sessions = sorted({r.session_id for r in requests if r.session_id})
        cap = self._cfg.max_inflight_per_replica
        while True:
            started = loop.time()
            snap = admit(
                await self.registry.snapshot(sessions=sessions),
                min(r.min_weight_version for r in requests),
                self._cfg.max_queue_per_replica,
                len(requests),
            )
            give_up = route_give_up(give_up, started, loop.time(), self._route_wait_s, deadline)
            try:
                plan = assign(requests, snap, cap, self._rng, self._round_robin)
                break
            except Unavailable:
                if loop.time() + ROUTE_POLL_S > give_up:
                    raise
                await asyncio.sleep(ROUTE_POLL_S)
        await self.registry.claim_many(plan.counts, plan.pins, self._cfg.sticky_ttl_s)
        return plan

    async def _collect(
        self, entries: dict[str, str], plan: Assignment, done: dict[str, Result], epoch: str
    ) -> tuple[dict[str, Outcome], dict[str, int]]:
        """Each member's outcome (its stored answer, or its entry's failure), and how many
        requests each serving replica held (a migrated entry counts where it was served).
        Members whose answers vanished with the server's data after their entry's answer was
        seen (an empty restart in between) raise ``Vanished``, so they are queued again."""
        answered = [
            r.request_id for eid, rid in entries.items() if done[eid].ok for r in plan.groups[rid]
        ]
        stored = await self._answers.get_results(answered)
        lost = [rid for rid in answered if rid not in stored]
        if lost and await self._answers.epoch() != epoch:
            raise Vanished(lost)
        outcomes: dict[str, Outcome] = {}
        served: Counter[str] = Counter()
        for eid, rid in entries.items():
            group = [r.request_id for r in plan.groups[rid]]
            for member in group:
                result = stored.get(member, missing(member)) if done[eid].ok else done[eid]
                outcomes[member] = outcome(member, result)
            by = [o.replica_id for m in group if isinstance(o := outcomes[m], GenerateResult)]
            served[next((b for b in by if b), rid)] += len(group)
        return outcomes, served


def _batch_timeout(pending: list[str], entries: dict[str, str]) -> TimeoutError:
    where = ", ".join(sorted(entries[eid] for eid in pending))
    return TimeoutError(
        f"{len(pending)} of {len(entries)} batch entries (routed to {where}) got no answer in time"
    )


def _validate_batch(requests: Sequence[GenerateRequest]) -> None:
    for request in requests:
        request.validate()
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        dup = next(rid for rid in ids if ids.count(rid) > 1)
        raise InvalidArgument(f"request id {dup!r} appears more than once in the batch")
