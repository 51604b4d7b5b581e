"""The router's core: pick a replica, queue the request on its stream, return the answer.

Why the state lives in Redis (registry, sticky map, in-flight counts, draining set): several
routers can run side by side and agree on load and affinity, and a restarted router loses
nothing. Why requests go through each replica's own stream rather than a direct RPC: a replica
that dies mid-request leaves its work in the stream, and the janitor here hands that work to a
live replica, so the caller still gets its answer (request ids make the answer unique).

No grpc here: ``router_server.py`` converts protobuf to the plain objects in ``types.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from dataclasses import dataclass, field

from redis.asyncio import Redis

from services.common.config import RlfleetConfig
from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.common.keys import Keys
from services.common.workqueue import Result, WorkQueue, decode_result
from services.rollout.registry import ReplicaInfo
from services.rollout.routing import pick_replica
from services.rollout.types import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)

GROUP = "rollout"
ROUTE_WAIT_S = 3.0  # how long a request waits for an eligible replica (registrations, updates)
ROUTE_POLL_S = 0.1
LOCK_TTL_MS = 30_000

# Decrement, never below zero (a replica deregistered meanwhile has no field); unlock if ours.
_RELEASE_LUA = """
local n = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if n > 0 then return redis.call('HINCRBY', KEYS[1], ARGV[1], -1) end
return 0
"""
_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass
class ReplicaView:
    """A replica as the router sees it: registry entry, load and whether it is drained."""

    info: ReplicaInfo
    in_flight: int = 0
    draining: bool = False

    @property
    def state(self) -> str:
        if not self.info.alive:
            return "dead"
        return "draining" if self.draining else self.info.state


@dataclass
class Snapshot:
    """Routing state read from Redis in two round trips."""

    replicas: list[ReplicaInfo]
    inflight: dict[str, int] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)
    sticky: str | None = None


class RouterCore:
    """Routes GenerateRequests to replicas; ``start()`` runs the dead-replica janitor."""

    def __init__(
        self, redis: Redis, keys: Keys, config: RlfleetConfig, rng: random.Random | None = None
    ) -> None:
        self._redis, self._keys, self._cfg = redis, keys, config.router
        self._route_wait_s = getattr(config.router, "route_wait_s", ROUTE_WAIT_S)
        self._queues: dict[str, WorkQueue] = {}
        self._release_script = redis.register_script(_RELEASE_LUA)
        self._unlock_script = redis.register_script(_UNLOCK_LUA)
        self._rng = rng or random.Random()
        self._token = uuid.uuid4().hex
        self._suspects: set[str] = set()  # dead replicas this router already emptied once
        self._janitor: asyncio.Task | None = None

    def start(self) -> None:
        self._janitor = asyncio.create_task(self._janitor_loop(), name="router-janitor")

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
            await asyncio.gather(self._janitor, return_exceptions=True)
            self._janitor = None

    # ---- generation --------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Answer one request (idempotent on ``request_id``)."""
        request.validate()
        stored = await self._redis.get(self._keys.result(request.request_id))
        if stored is not None:
            return _unpack(decode_result(request.request_id, stored))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (request.timeout_s or self._cfg.request_timeout_s)
        routed = await self._route(request, deadline)
        served_by = routed
        try:
            queue = self._queue(routed)
            submitted = await queue.submit(request.request_id, request.to_json())
            answer = _unpack(await self._wait(queue, request.request_id, routed, deadline))
            if submitted:  # a migrated request was counted on the replica that served it
                served_by = answer.replica_id or routed
            return answer
        finally:
            await self._release_script(keys=[self._keys.inflight], args=[served_by])

    async def _route(self, request: GenerateRequest, deadline: float) -> str:
        """Choose a replica, waiting briefly for one to register or reach the version."""
        loop = asyncio.get_running_loop()
        give_up = min(deadline, loop.time() + self._route_wait_s)
        while True:
            snap = await self._snapshot(request.session_id)
            try:
                replica_id = self._choose(snap, request.min_weight_version, snap.sticky)
                break
            except Unavailable:
                if loop.time() + ROUTE_POLL_S > give_up:
                    raise
                await asyncio.sleep(ROUTE_POLL_S)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hincrby(self._keys.inflight, replica_id, 1)
            if request.session_id:
                ttl_ms = int(self._cfg.sticky_ttl_s * 1000)
                pipe.set(self._keys.sticky(request.session_id), replica_id, px=ttl_ms)
            await pipe.execute()
        return replica_id

    def _choose(self, snap: Snapshot, min_version: int, sticky: str | None) -> str:
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
        snap = await self._snapshot(None)
        return [
            ReplicaView(r, snap.inflight.get(r.replica_id, 0), r.replica_id in snap.draining)
            for r in snap.replicas
        ]

    async def drain_replica(self, replica_id: str) -> ReplicaView:
        """Stop routing new work to a replica; it keeps answering what is already queued."""
        if not await self._redis.sismember(self._keys.replicas, replica_id):
            raise NotFound(f"no replica {replica_id!r} is registered")
        await self._redis.sadd(self._keys.draining, replica_id)
        log.info("draining replica %s: no new requests will be routed to it", replica_id)
        views = {v.info.replica_id: v for v in await self.list_replicas()}
        if replica_id not in views:
            raise NotFound(f"replica {replica_id!r} deregistered meanwhile")
        return views[replica_id]

    async def _snapshot(self, session_id: str | None) -> Snapshot:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.smembers(self._keys.replicas)
            pipe.hgetall(self._keys.inflight)
            pipe.smembers(self._keys.draining)
            if session_id:
                pipe.get(self._keys.sticky(session_id))
            members, inflight, draining, *sticky = await pipe.execute()
        ids = sorted(_text(m) for m in members)
        async with self._redis.pipeline(transaction=False) as pipe:
            for replica_id in ids:
                pipe.hgetall(self._keys.replica(replica_id))
                pipe.exists(self._keys.heartbeat(replica_id))
            replies = await pipe.execute()
        infos = [
            ReplicaInfo.from_hash(rid, raw, bool(alive))
            for rid, raw, alive in zip(ids, replies[::2], replies[1::2], strict=True)
        ]
        return Snapshot(
            replicas=infos,
            inflight={_text(k): int(v) for k, v in inflight.items()},
            draining={_text(d) for d in draining},
            sticky=_text(sticky[0]) if sticky and sticky[0] else None,
        )

    def _queue(self, replica_id: str) -> WorkQueue:
        if replica_id not in self._queues:
            stream = self._keys.rollout_stream(replica_id)
            self._queues[replica_id] = WorkQueue(self._redis, self._keys, stream, GROUP)
        return self._queues[replica_id]

    # ---- janitor -----------------------------------------------------------------------

    async def _janitor_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep sweeping (e.g. Redis restarting)
                log.warning(
                    "janitor sweep failed, retrying in %.1fs: %s", self._cfg.janitor_interval_s, exc
                )
            await asyncio.sleep(self._cfg.janitor_interval_s)

    async def sweep(self) -> int:
        """Re-route the queued work of replicas whose heartbeat expired; returns how many moved.

        A dead replica is deregistered only once a sweep finds its stream empty after an
        earlier sweep emptied it, which catches a request routed to it just before it died.
        """
        snap = await self._snapshot(None)
        dead = [r.replica_id for r in snap.replicas if not r.alive]
        self._suspects &= set(dead)
        lock = self._keys.janitor_lock
        if not dead or not await self._redis.set(lock, self._token, nx=True, px=LOCK_TTL_MS):
            return 0
        try:
            return sum([await self._evacuate(replica_id) for replica_id in dead])
        finally:
            await self._unlock_script(keys=[lock], args=[self._token])

    async def _evacuate(self, dead_id: str) -> int:
        entries = await self._queue(dead_id).drain_entries()
        if not entries and dead_id in self._suspects:
            await self._forget(dead_id)
            return 0
        self._suspects.add(dead_id)
        snap = await self._snapshot(None)
        moved = sum([await self._reroute(snap, dead_id, *entry) for entry in entries])
        if entries:
            log.warning(
                "replica %s is dead: re-routed %d of its %d queued requests (%d wait for an eligible replica)",
                dead_id, moved, len(entries), len(entries) - moved,
            )  # fmt: skip
        return moved

    async def _reroute(self, snap: Snapshot, dead_id: str, request_id: str, payload: bytes) -> int:
        """Queue one request on a live replica (1), or put it back to retry next sweep (0)."""
        try:
            min_version = json.loads(payload).get("min_weight_version", 0)
            target = self._choose(snap, int(min_version), None)
        except Unavailable as exc:
            log.warning(
                "request %s from dead replica %s not re-routed yet: %s", request_id, dead_id, exc
            )
            await self._queue(dead_id).submit(request_id, payload)
            return 0
        except (ValueError, AttributeError) as exc:
            log.warning("dropping unreadable request %s from %s: %s", request_id, dead_id, exc)
            return 0
        if await self._queue(target).submit(request_id, payload):
            await self._redis.hincrby(self._keys.inflight, target, 1)
            snap.inflight[target] = snap.inflight.get(target, 0) + 1
        return 1

    async def _forget(self, dead_id: str) -> None:
        if await self._redis.exists(self._keys.heartbeat(dead_id)):
            return  # restarted under the same id meanwhile: it owns its entries again
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.srem(self._keys.replicas, dead_id)
            pipe.srem(self._keys.draining, dead_id)
            pipe.delete(self._keys.replica(dead_id), self._keys.heartbeat(dead_id))
            pipe.delete(self._keys.rollout_stream(dead_id))
            pipe.hdel(self._keys.inflight, dead_id)
            await pipe.execute()
        self._suspects.discard(dead_id)
        self._queues.pop(dead_id, None)
        log.warning("deregistered dead replica %s (heartbeat expired, queue empty)", dead_id)


def _unpack(result: Result) -> GenerateResult:
    """The stored answer, or the error it carries as an exception with the right status."""
    if result.ok:
        return GenerateResult.from_json(result.payload)
    if result.error and result.error.startswith("InvalidArgument"):
        raise InvalidArgument(f"request {result.request_id}: {result.error}")
    raise Unavailable(f"request {result.request_id} failed on a replica: {result.error}")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
