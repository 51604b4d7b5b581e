"""The router's core: pick a replica, queue the request on its stream, return the answer.

Why the state lives in Redis (registry, sticky map, in-flight counts, draining set): several
routers can run side by side and agree on load and affinity, and a restarted router loses
nothing. Why requests go through each replica's own stream rather than a direct RPC: a replica
that dies mid-request leaves its work in the stream, and the janitor here hands that work to a
live replica (``janitor.py``), so the caller still gets its answer (request ids make the
answer unique). Every read and write of that state goes through ``ReplicaRegistry``.
``generate_batch`` answers a whole step with one queue entry per replica (see ``batch.py``).
Every call is counted and timed in ``metrics`` (Prometheus; ``metrics.py``), whichever front
door (gRPC ``server.py``, HTTP ``http.py``) it came through.

No grpc here: ``server.py`` converts protobuf to the plain objects in ``types.py``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import ErrorCode, InvalidArgument, NotFound, RlfleetError, Unavailable
from rlfleet.common.keys import ROLLOUT_GROUP, Keys
from rlfleet.common.workqueue import Result, WorkQueue, decode_result
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router.batch import Assignment, assign, stored_results, wait_entries
from rlfleet.rollout.router.janitor import Janitor
from rlfleet.rollout.router.metrics import RouterMetrics
from rlfleet.rollout.router.routing import loading, pick_replica
from rlfleet.rollout.types import (
    GenerateRequest,
    GenerateResult,
    ReplicaState,
    ReplicaStatus,
    pack_requests,
)

log = logging.getLogger(__name__)

GROUP = ROLLOUT_GROUP
ROUTE_POLL_S = 0.1


@dataclass
class ReplicaView:
    """A replica as the router sees it: registry entry, load and whether it is drained."""

    info: ReplicaInfo
    in_flight: int = 0
    draining: bool = False

    @property
    def state(self) -> ReplicaState:
        if not self.info.alive and not loading(self.info):
            return ReplicaState.DEAD
        return ReplicaState.DRAINING if self.draining else self.info.state

    def status(self) -> ReplicaStatus:
        info = self.info
        return ReplicaStatus(info.replica_id, info.address, info.weight_version, self.state,
                             self.in_flight, info.backend, info.served, info.heartbeat_age_s)  # fmt: skip


class RouterCore:
    """Routes GenerateRequests to replicas; ``start()`` runs the dead-replica janitor."""

    def __init__(
        self, redis: Redis, keys: Keys, config: RlfleetConfig, rng: random.Random | None = None
    ) -> None:
        self._redis, self._keys, self._cfg = redis, keys, config.router
        self.registry = ReplicaRegistry(redis, keys, config.rollout.heartbeat_ttl_s)
        self._route_wait_s = config.router.route_wait_s
        self._queues: dict[str, WorkQueue] = {}
        self._rng = rng or random.Random()
        self.metrics = RouterMetrics()
        self.janitor = Janitor(self, self.registry, config.router.janitor_interval_s,
                               self.metrics.migrated)  # fmt: skip

    def start(self) -> None:
        """Start the janitor that rescues work queued on dead or departed replicas."""
        self.janitor.start()

    async def close(self) -> None:
        await self.janitor.close()

    # ---- generation --------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Answer one request (idempotent on ``request_id``)."""
        with self.metrics.track("generate"):
            return await self._generate(request)

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        request.validate()
        stored = await self._redis.get(self._keys.result(request.request_id))
        if stored is not None:
            return _unpack(decode_result(request.request_id, stored))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (request.timeout_s or self._cfg.request_timeout_s)
        routed = await self._route(request, deadline)
        served_by = routed
        try:
            queue = self.queue(routed)
            submitted = await queue.submit(request.request_id, request.to_json())
            answer = _unpack(await self._wait(queue, request.request_id, routed, deadline))
            if submitted:  # a migrated request was counted on the replica that served it
                served_by = answer.replica_id or routed
            return answer
        finally:
            await self.registry.release(served_by)

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Answer many requests, in order, with one queue entry per replica and a few round
        trips in all (``batch.py``). Idempotent per request id, like ``generate``; the first
        failure in request order fails the call (as a gather of ``generate`` calls would)."""
        with self.metrics.track("generate_batch", max(1, len(requests))):
            return await self._generate_batch(requests)

    async def _generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        _validate_batch(requests)
        ids = [r.request_id for r in requests]
        stored = await stored_results(self._redis, self._keys, ids)
        outcomes = {rid: _outcome(rid, result) for rid, result in stored.items()}
        if todo := [r for r in requests if r.request_id not in stored]:
            outcomes |= await self._run_batch(todo)
        return [_raise_or_return(outcomes[rid]) for rid in ids]

    async def _run_batch(self, requests: list[GenerateRequest]) -> dict[str, _Outcome]:
        """Route, claim, queue one entry per replica, wait for them all, release."""
        loop = asyncio.get_running_loop()
        timeout_s = max(r.timeout_s for r in requests) or self._cfg.request_timeout_s
        deadline = loop.time() + timeout_s
        plan = await self._route_batch(requests, deadline)
        entries = {f"batch-{uuid.uuid4().hex}-{rid}": rid for rid in plan.groups}
        served = plan.counts  # released as routed unless answers say who served
        try:
            await asyncio.gather(*(self.queue(rid).submit(eid, pack_requests(plan.groups[rid]))
                                   for eid, rid in entries.items()))  # fmt: skip
            done = await wait_entries(self._redis, self._keys, list(entries), deadline,
                                      lambda pending: _batch_timeout(pending, entries))  # fmt: skip
            outcomes, served = await self._collect(entries, plan, done)
            return outcomes
        finally:
            await self.registry.release_many(served)

    async def _route_batch(self, requests: list[GenerateRequest], deadline: float) -> Assignment:
        """Place every request from one snapshot (waiting briefly, like ``_route``); claim."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self._route_wait_s)
        sessions = sorted({r.session_id for r in requests if r.session_id})
        cap = self._cfg.max_inflight_per_replica
        while True:
            snap = await self.registry.snapshot(sessions=sessions)
            try:
                plan = assign(requests, snap, cap, self._rng)
                break
            except Unavailable:
                if loop.time() + ROUTE_POLL_S > give_up:
                    raise
                await asyncio.sleep(ROUTE_POLL_S)
        await self.registry.claim_many(plan.counts, plan.pins, self._cfg.sticky_ttl_s)
        return plan

    async def _collect(
        self, entries: dict[str, str], plan: Assignment, done: dict[str, Result]
    ) -> tuple[dict[str, _Outcome], dict[str, int]]:
        """Each member's outcome (its stored answer, or its entry's failure), and how many
        requests each serving replica held (a migrated entry counts where it was served)."""
        answered = [r.request_id for eid, rid in entries.items() if done[eid].ok
                    for r in plan.groups[rid]]  # fmt: skip
        stored = await stored_results(self._redis, self._keys, answered)
        outcomes: dict[str, _Outcome] = {}
        served: Counter[str] = Counter()
        for eid, rid in entries.items():
            group = [r.request_id for r in plan.groups[rid]]
            for member in group:
                result = stored.get(member, _missing(member)) if done[eid].ok else done[eid]
                outcomes[member] = _outcome(member, result)
            by = [o.replica_id for m in group if isinstance(o := outcomes[m], GenerateResult)]
            served[next((b for b in by if b), rid)] += len(group)
        return outcomes, served

    async def _route(self, request: GenerateRequest, deadline: float) -> str:
        """Choose a replica, waiting briefly for one to register or reach the version."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self._route_wait_s)
        while True:
            snap = await self.registry.snapshot(request.session_id)
            try:
                replica_id = self.choose(snap, request.min_weight_version, snap.sticky)
                break
            except Unavailable:
                if loop.time() + ROUTE_POLL_S > give_up:
                    raise
                await asyncio.sleep(ROUTE_POLL_S)
        await self.registry.claim(replica_id, request.session_id, self._cfg.sticky_ttl_s)
        return replica_id

    def choose(self, snap: RegistrySnapshot, min_version: int, sticky: str | None) -> str:
        cap = self._cfg.max_inflight_per_replica
        args = (snap.inflight, sticky, min_version, cap, snap.draining, self._rng)
        return pick_replica(snap.replicas, *args)

    async def _wait(
        self, queue: WorkQueue, request_id: str, replica_id: str, deadline: float
    ) -> Result:
        remaining = deadline - asyncio.get_running_loop().time()
        result = await queue.wait_result(request_id, max(0.0, remaining))
        if result is None:
            raise TimeoutError(
                f"request {request_id} (routed to {replica_id}) got no answer in time"
            )
        return result

    # ---- replicas ----------------------------------------------------------------------

    async def list_replicas(self) -> list[ReplicaView]:
        snap = await self.registry.snapshot()
        return [
            ReplicaView(r, snap.inflight.get(r.replica_id, 0), r.replica_id in snap.draining)
            for r in snap.replicas
        ]

    async def drain_replica(self, replica_id: str) -> ReplicaView:
        """Stop routing new work to a replica; it keeps answering what is already queued."""
        if not await self.registry.is_registered(replica_id):
            raise NotFound(f"no replica {replica_id!r} is registered")
        await self.registry.mark_draining(replica_id)
        log.info("draining replica %s: no new requests will be routed to it", replica_id)
        views = {v.info.replica_id: v for v in await self.list_replicas()}
        if replica_id not in views:
            raise NotFound(f"replica {replica_id!r} deregistered meanwhile")
        return views[replica_id]

    async def scrape_metrics(self) -> bytes:
        """The Prometheus text, with per-replica gauges read from Redis just now."""
        views = await self.list_replicas()
        self.metrics.set_replicas((v.info.replica_id, v.in_flight, v.info.weight_version)
                                  for v in views)  # fmt: skip
        return self.metrics.render()

    def queue(self, replica_id: str) -> WorkQueue:
        if replica_id not in self._queues:
            stream = self._keys.rollout_stream(replica_id)
            self._queues[replica_id] = WorkQueue(self._redis, self._keys, stream, ROLLOUT_GROUP)
        return self._queues[replica_id]

    def forget_queue(self, replica_id: str) -> None:
        self._queues.pop(replica_id, None)


_Outcome = GenerateResult | RlfleetError


def _unpack(result: Result) -> GenerateResult:
    """The stored answer, or the error it carries as an exception with the right status."""
    return _raise_or_return(_outcome(result.request_id, result))


def _outcome(request_id: str, result: Result) -> _Outcome:
    """A stored answer decoded, or the exception its failure stands for (not raised)."""
    if result.ok:
        return GenerateResult.decode(result.payload)
    if result.code is ErrorCode.INVALID_ARGUMENT:
        return InvalidArgument(f"request {request_id}: {result.error}")
    return Unavailable(f"request {request_id} failed on a replica: {result.error}")


def _raise_or_return(outcome: _Outcome) -> GenerateResult:
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _missing(request_id: str) -> Result:
    """A member whose entry was answered but whose own answer is gone (expired)."""
    return Result(request_id, b"", ErrorCode.UNAVAILABLE, "its answer was not stored")


def _batch_timeout(pending: list[str], entries: dict[str, str]) -> TimeoutError:
    where = ", ".join(sorted(entries[eid] for eid in pending))
    return TimeoutError(f"{len(pending)} of {len(entries)} batch entries (routed to {where}) "
                        "got no answer in time")  # fmt: skip


def _validate_batch(requests: Sequence[GenerateRequest]) -> None:
    for request in requests:
        request.validate()
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        dup = next(rid for rid in ids if ids.count(rid) > 1)
        raise InvalidArgument(f"request id {dup!r} appears more than once in the batch")
