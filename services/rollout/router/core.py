"""The router's core: pick a replica, queue the request on its stream, return the answer.

Why the state lives in Redis (registry, sticky map, in-flight counts, draining set): several
routers can run side by side and agree on load and affinity, and a restarted router loses
nothing. Why requests go through each replica's own stream rather than a direct RPC: a replica
that dies mid-request leaves its work in the stream, and the janitor here hands that work to a
live replica (``janitor.py``), so the caller still gets its answer (request ids make the
answer unique). Every read and write of that state goes through ``ReplicaRegistry``, but
for the one Lua step that places and queues a single Generate (``enqueue.py``: three round
trips a request in all, routing from a registry copy at most ``SNAPSHOT_MAX_AGE_S`` old; the
third, releasing the in-flight count, runs after the answer has gone back).
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
from rlfleet.common.errors import (
    ErrorCode,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlfleetError,
    Unavailable,
)
from rlfleet.common.keys import ROLLOUT_GROUP, Keys
from rlfleet.common.workqueue import Result, WorkQueue
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router.admission import admit
from rlfleet.rollout.router.batch import Assignment, assign, stored_results, wait_entries
from rlfleet.rollout.router.enqueue import Enqueued, Enqueuer, Placed, Placement, SnapshotCache
from rlfleet.rollout.router.janitor import Janitor
from rlfleet.rollout.router.metrics import RouterMetrics
from rlfleet.rollout.router.routing import RoundRobin, eligible, loading, pick_replica, why_none
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
SNAPSHOT_MAX_AGE_S = 0.25
"""How old a registry read a routing decision may use (``enqueue.SnapshotCache``): the Lua
step re-checks the pick's state, version, drain mark and queue live, so an old copy costs a
retry, not a wrong placement."""
WAKE_POLL_S = 1.0  # longest wait on a wake-up before the answer key is read anyway
_NO_STREAM = "_"  # replica ids never start a stream that this queue object would touch
_REUSED = "request_id {!r} is already in use for a different prompt or sampling"


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
        self._snapshots = SnapshotCache(self.registry, SNAPSHOT_MAX_AGE_S)
        self._enqueuer = Enqueuer(redis, keys)
        self._route_wait_s = config.router.route_wait_s
        self._queues: dict[str, WorkQueue] = {}
        self._rng = rng or random.Random()
        self._round_robin = RoundRobin() if config.router.policy == "round_robin" else None
        self.metrics = RouterMetrics()
        self._releases: set[asyncio.Task] = set()  # in-flight releases still under way
        self.janitor = Janitor(self, self.registry, config.router.janitor_interval_s,
                               self.metrics.migrated, config.router.debug_move_delay_s)  # fmt: skip

    def start(self) -> None:
        """Start the janitor that rescues work queued on dead or departed replicas."""
        self.janitor.start()

    async def close(self) -> None:
        await self.janitor.close()
        await asyncio.gather(*self._releases, return_exceptions=True)

    # ---- generation --------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Answer one request (idempotent on ``request_id``)."""
        with self.metrics.track("generate"):
            return await self._generate(request)

    async def _generate(self, request: GenerateRequest) -> GenerateResult:
        """Queue the request once per id (bound to its content in the same Lua step that
        places it) and wait for its answer; the last waiter to give up (timeout,
        cancellation) has its execution aborted. Three round trips in all: the enqueue, the
        wake-up that carries the answer, and the release, after the answer is returned."""
        request.validate()
        deadline = asyncio.get_running_loop().time() + (
            request.timeout_s or self._cfg.request_timeout_s
        )
        placed = await self._place(request, deadline)
        if placed.stored is not None:
            return _unpack(placed.stored)
        served_by = placed.replica_id or None  # queued by us: counted in flight there
        try:
            result = await self._wait(request.request_id, placed.replica_id, deadline)
        except BaseException:
            await self._after_no_answer(request.request_id, served_by)
            raise
        try:
            answer = _unpack(result)
        except BaseException:  # an answered failure (the replica refused the request)
            if served_by is not None:
                self._release_later(served_by)
            raise
        if served_by is not None:  # a migrated request was counted where it was served
            self._release_later(self._served_by(answer, served_by))
        return answer

    def _release_later(self, replica_id: str) -> None:
        """Release an answered request's in-flight count after the caller has its answer: the
        count only steers the next routing decision, so the round trip need not delay this
        one (``close`` waits for the releases still under way)."""
        task = asyncio.create_task(self._release(replica_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, replica_id: str) -> None:
        try:
            await self.registry.release(replica_id)
        except Exception as exc:  # noqa: BLE001 - the janitor's recount repairs a lost one
            log.warning("releasing a request on %s failed: %s", replica_id, exc)

    async def _after_no_answer(self, rid: str, served_by: str | None) -> None:
        """Release our in-flight count and stop counting ourselves a waiter: the last one out
        gives the request up (its replica aborts it; a retry under the id is queued afresh)."""
        try:
            if served_by is not None:
                await self.registry.release(served_by)
        finally:
            self._snapshots.invalidate()  # its replica may be gone
            await self._leave(rid)

    async def _leave(self, rid: str) -> None:
        try:
            if await self.queue_for_any().leave(rid):
                log.info("request %s: every caller gave up, cancelling it", rid)
        except Exception as exc:  # noqa: BLE001 - the caller's own outcome matters more
            log.warning("request %s: could not update its waiters: %s", rid, exc)

    def _served_by(self, answer: GenerateResult, routed: str) -> str:
        if answer.replica_id and answer.replica_id != routed:
            self._snapshots.invalidate()  # moved: the replica we chose likely died or left
        return answer.replica_id or routed

    async def _place(self, request: GenerateRequest, deadline: float) -> Enqueued:
        """Bind, place and queue in one step (``enqueue.py``) among candidates from the cached
        registry. A refusal that an old copy may explain is retried on a fresh read; with no
        eligible replica we wait up to ``route_wait_s`` for one, as before."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self._route_wait_s)
        submission, fresh = uuid.uuid4().hex, False
        while True:
            try:
                placed = await self._try_place(request, submission, deadline, fresh)
            except Unavailable:
                if fresh and loop.time() + ROUTE_POLL_S > give_up:
                    raise
                placed = None
            if placed is not None and placed.outcome not in (Placed.STALE, Placed.FULL):
                return placed
            if placed is not None and fresh:
                _refuse(placed, request.request_id, self._cfg.max_queue_per_replica,
                        loop.time() + ROUTE_POLL_S > give_up)  # fmt: skip
            if fresh:
                await asyncio.sleep(ROUTE_POLL_S)
            fresh = True

    async def _try_place(
        self, request: GenerateRequest, submission: str, deadline: float, fresh: bool
    ) -> Enqueued:
        """One attempt; raises Unavailable (no eligible replica), ResourceExhausted (a fresh
        read finds every queue full), InvalidArgument (the id is bound to other content)."""
        snap, min_version = await self._snapshots.get(fresh), request.min_weight_version
        if fresh:  # says why, with the counts just read, when every queue is full
            snap = admit(snap, min_version, self._cfg.max_queue_per_replica)
        candidates = self._candidates(snap, min_version)
        cfg, loop = self._cfg, asyncio.get_running_loop()
        placement = Placement(cfg.max_inflight_per_replica, cfg.max_queue_per_replica,
                              cfg.sticky_ttl_s, self._rng.random())  # fmt: skip
        waiters_ttl_s = int(max(0.0, deadline - loop.time())) + 60
        placed = await self._enqueuer.enqueue(request, request.fingerprint(), submission,
                                              candidates, placement, waiters_ttl_s,
                                              pin=self._round_robin is None)  # fmt: skip
        if placed.outcome is Placed.CONFLICT:
            raise InvalidArgument(_REUSED.format(request.request_id))
        return placed

    def _candidates(self, snap: RegistrySnapshot, min_version: int) -> list[str]:
        """Replicas the request may go to (sorted ids); the Lua step picks among them."""
        if self._round_robin is not None:
            return [self._round_robin.pick(snap.replicas, min_version, snap.draining)]
        pool = eligible(snap.replicas, min_version, snap.draining)
        if not pool:
            raise Unavailable(why_none(snap.replicas, min_version, snap.draining))
        return sorted(r.replica_id for r in pool)

    def queue_for_any(self) -> WorkQueue:
        """A queue object for request-level calls (bindings) that use no stream."""
        return self.queue(_NO_STREAM)

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
        """Place every request from one snapshot (waiting briefly, like ``_place``); claim."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self._route_wait_s)
        sessions = sorted({r.session_id for r in requests if r.session_id})
        cap = self._cfg.max_inflight_per_replica
        while True:
            snap = admit(await self.registry.snapshot(sessions=sessions),
                         min(r.min_weight_version for r in requests),
                         self._cfg.max_queue_per_replica, len(requests))  # fmt: skip
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

    def choose(self, snap: RegistrySnapshot, min_version: int, sticky: str | None) -> str:
        if self._round_robin is not None:
            return self._round_robin.pick(snap.replicas, min_version, snap.draining)
        cap = self._cfg.max_inflight_per_replica
        args = (snap.inflight, sticky, min_version, cap, snap.draining, self._rng)
        return pick_replica(snap.replicas, *args)

    async def _wait(self, request_id: str, routed: str, deadline: float) -> Result:
        """The answer (one BLPOP: the wake-up carries it), or TimeoutError at ``deadline``."""
        remaining = max(0.0, deadline - asyncio.get_running_loop().time())
        result = await self.queue_for_any().wait_answer(request_id, remaining, WAKE_POLL_S)
        if result is None:
            where = f"routed to {routed}" if routed else "queued by an earlier call"
            raise TimeoutError(f"request {request_id} ({where}) got no answer in time")
        return result

    # ---- replicas ----------------------------------------------------------------------

    async def list_replicas(self) -> list[ReplicaView]:
        snap = await self.registry.snapshot()
        self._snapshots.put(snap)
        return [
            ReplicaView(r, snap.inflight.get(r.replica_id, 0), r.replica_id in snap.draining)
            for r in snap.replicas
        ]

    async def drain_replica(self, replica_id: str) -> ReplicaView:
        """Stop routing new work to a replica; it keeps answering what is already queued."""
        if not await self.registry.is_registered(replica_id):
            raise NotFound(f"no replica {replica_id!r} is registered")
        await self.registry.mark_draining(replica_id)
        self._snapshots.invalidate()
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


def _refuse(placed: Enqueued, request_id: str, limit: int | None, late: bool) -> None:
    """A fresh read did not explain a refusal of the Lua step: raise at once when every queue
    is full (admission), or when it keeps happening past the routing wait."""
    if placed.outcome is Placed.FULL:
        raise ResourceExhausted(f"every replica's queue is full (router.max_queue_per_replica="
                                f"{limit}): no room for request {request_id}; retry later")  # fmt: skip
    if late:
        raise Unavailable(f"replica {placed.replica_id} kept changing state while request "
                          f"{request_id} was routed; retry")  # fmt: skip


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
