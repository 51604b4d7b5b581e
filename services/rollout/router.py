"""The router's core: pick a replica, queue the request on its stream, return the answer.

Why the state lives in Redis (registry, sticky map, in-flight counts, draining set): several
routers can run side by side and agree on load and affinity, and a restarted router loses
nothing. Why requests go through each replica's own stream rather than a direct RPC: a replica
that dies mid-request leaves its work in the stream, and the janitor here hands that work to a
live replica (``router_janitor.py``), so the caller still gets its answer (request ids make
the answer unique).

No grpc here: ``router_server.py`` converts protobuf to the plain objects in ``types.py``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from redis.asyncio import Redis

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import InvalidArgument, NotFound, Unavailable
from rlfleet.common.keys import Keys
from rlfleet.common.workqueue import Result, WorkQueue, decode_result
from rlfleet.rollout.registry import ReplicaInfo
from rlfleet.rollout.router_janitor import Janitor
from rlfleet.rollout.routing import loading, pick_replica
from rlfleet.rollout.types import GenerateRequest, GenerateResult

log = logging.getLogger(__name__)

GROUP = "rollout"
ROUTE_POLL_S = 0.1

# Decrement, never below zero (a replica deregistered meanwhile has no field).
_RELEASE_LUA = """
local n = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if n > 0 then return redis.call('HINCRBY', KEYS[1], ARGV[1], -1) end
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
        if not self.info.alive and not loading(self.info):
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
        self._route_wait_s = config.router.route_wait_s
        self._queues: dict[str, WorkQueue] = {}
        self._release_script = redis.register_script(_RELEASE_LUA)
        self._rng = rng or random.Random()
        self.janitor = Janitor(self, redis, keys, config.router.janitor_interval_s)

    def start(self) -> None:
        """Start the janitor that rescues work queued on dead or departed replicas."""
        self.janitor.start()

    async def close(self) -> None:
        await self.janitor.close()

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
            queue = self.queue(routed)
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
            snap = await self.snapshot(request.session_id)
            try:
                replica_id = self.choose(snap, request.min_weight_version, snap.sticky)
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

    def choose(self, snap: Snapshot, min_version: int, sticky: str | None) -> str:
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
        snap = await self.snapshot(None)
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

    async def snapshot(self, session_id: str | None) -> Snapshot:
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

    def queue(self, replica_id: str) -> WorkQueue:
        if replica_id not in self._queues:
            stream = self._keys.rollout_stream(replica_id)
            self._queues[replica_id] = WorkQueue(self._redis, self._keys, stream, GROUP)
        return self._queues[replica_id]

    def forget_queue(self, replica_id: str) -> None:
        self._queues.pop(replica_id, None)


def _unpack(result: Result) -> GenerateResult:
    """The stored answer, or the error it carries as an exception with the right status."""
    if result.ok:
        return GenerateResult.from_json(result.payload)
    if result.error and result.error.startswith("InvalidArgument"):
        raise InvalidArgument(f"request {result.request_id}: {result.error}")
    raise Unavailable(f"request {result.request_id} failed on a replica: {result.error}")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
