"""One routed Generate: placed and queued in one Lua step, its answer awaited, its count released.

Three round trips a request in all: the enqueue (``enqueue.py``: bind the id to the request's
content, pick the replica from candidates of a registry copy at most ``SNAPSHOT_MAX_AGE_S``
old, queue the entry, count it in flight), the wake-up that carries the answer, and the
release of the in-flight count, which runs after the answer has gone back. Idempotent on
``request_id``: a second call with the same id joins the execution already queued (or gets
the stored answer); the last waiter to give up (timeout, cancellation) has the execution
aborted on its replica.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

from rlfleet.common.config import RouterConfig
from rlfleet.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from rlfleet.common.queue.answers import Answers, Vanished
from rlfleet.common.queue.results import Result
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaRegistry
from rlfleet.rollout.router.admission import admit
from rlfleet.rollout.router.enqueue import Enqueued, Enqueuer, Placed, Placement, SnapshotCache
from rlfleet.rollout.router.outage import route_give_up
from rlfleet.rollout.router.outcomes import unpack
from rlfleet.rollout.router.routing import RoundRobin, eligible, why_none
from rlfleet.rollout.types import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)

ROUTE_POLL_S = 0.1  # between routing attempts while no replica can take a request
WAKE_POLL_S = 1.0  # longest wait on a wake-up before the answer key is read anyway
_REUSED = "request_id {!r} is already in use for a different prompt or sampling"


class RequestPath:
    """Answers single requests; ``close`` waits for the releases still under way."""

    def __init__(
        self,
        cfg: RouterConfig,
        registry: ReplicaRegistry,
        snapshots: SnapshotCache,
        enqueuer: Enqueuer,
        rng: random.Random,
        round_robin: RoundRobin | None,
        answers: Answers,
    ) -> None:
        self._cfg, self.registry, self._snapshots = cfg, registry, snapshots
        self._enqueuer, self._rng, self._round_robin = enqueuer, rng, round_robin
        self._answers = answers  # each request's answer, binding and waiters
        self._route_wait_s = cfg.route_wait_s
        self._releases: set[asyncio.Task] = set()  # in-flight releases still under way

    async def close(self) -> None:
        await asyncio.gather(*self._releases, return_exceptions=True)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
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
            return unpack(placed.stored)
        served_by = placed.replica_id or None  # queued by us: counted in flight there
        try:
            result = await self._wait(request, placed.replica_id, deadline)
        except BaseException:
            await self._after_no_answer(request.request_id, served_by)
            raise
        try:
            answer = unpack(result)
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
            if await self._answers.leave(rid):
                log.debug("request %s: every caller gave up, cancelling it", rid)
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
            started, failure = loop.time(), None
            try:
                placed = await self._try_place(request, submission, deadline, fresh)
            except Unavailable as exc:
                placed, failure = None, exc
            give_up = route_give_up(give_up, started, loop.time(), self._route_wait_s, deadline)
            if failure is not None and fresh and loop.time() + ROUTE_POLL_S > give_up:
                raise failure
            if placed is not None and placed.outcome not in (Placed.STALE, Placed.FULL):
                return placed
            if placed is not None and fresh:
                _refuse(
                    placed,
                    request.request_id,
                    self._cfg.max_queue_per_replica,
                    loop.time() + ROUTE_POLL_S > give_up,
                )
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
        placement = Placement(
            cfg.max_inflight_per_replica,
            cfg.max_queue_per_replica,
            cfg.sticky_ttl_s,
            self._rng.random(),
        )
        waiters_ttl_s = int(max(0.0, deadline - loop.time())) + 60
        placed = await self._enqueuer.enqueue(
            request,
            request.fingerprint(),
            submission,
            candidates,
            placement,
            waiters_ttl_s,
            pin=self._round_robin is None,
        )
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

    async def _wait(self, request: GenerateRequest, routed: str, deadline: float) -> Result:
        """The answer (one BLPOP: the wake-up carries it), or TimeoutError at ``deadline``.
        A request the server lost (an empty Redis restart: its binding is gone with its entry)
        is placed again and awaited anew; answers are ``SET NX``, so it is answered once."""
        request_id, loop = request.request_id, asyncio.get_running_loop()
        while True:
            remaining = max(0.0, deadline - loop.time())
            try:
                result = await self._answers.wait_answer(
                    request_id, remaining, WAKE_POLL_S, bound=True
                )
                break
            except Vanished:
                log.warning(
                    "request %s was lost by Redis (restarted empty?): queued again", request_id
                )
                placed = await self._place(request, deadline)
                if placed.stored is not None:
                    return placed.stored
                routed = placed.replica_id or routed
        if result is None:
            where = f"routed to {routed}" if routed else "queued by an earlier call"
            raise TimeoutError(f"request {request_id} ({where}) got no answer in time")
        return result


def _refuse(placed: Enqueued, request_id: str, limit: int | None, late: bool) -> None:
    """A fresh read did not explain a refusal of the Lua step: raise at once when every queue
    is full (admission), or when it keeps happening past the routing wait."""
    if placed.outcome is Placed.FULL:
        raise ResourceExhausted(
            f"every replica's queue is full (router.max_queue_per_replica="
            f"{limit}): no room for request {request_id}; retry later"
        )
    if late:
        raise Unavailable(
            f"replica {placed.replica_id} kept changing state while request "
            f"{request_id} was routed; retry"
        )
