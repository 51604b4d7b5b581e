"""The router's core: pick a replica, queue the request on its stream, return the answer.

Why the state lives in Redis (registry, sticky map, in-flight counts, draining set): several
routers can run side by side and agree on load and affinity, and a restarted router loses
nothing. Why requests go through each replica's own stream rather than a direct RPC: a replica
that dies mid-request leaves its work in the stream, and the janitor here hands that work to a
live replica (``janitor.py``), so the caller still gets its answer (request ids make the
answer unique). Every read and write of that state goes through ``ReplicaRegistry``.

No grpc here: ``server.py`` converts protobuf to the plain objects in ``types.py``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from redis.asyncio import Redis

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import ErrorCode, InvalidArgument, NotFound, Unavailable
from rlfleet.common.keys import ROLLOUT_GROUP, Keys
from rlfleet.common.workqueue import Result, WorkQueue, decode_result
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router.janitor import Janitor
from rlfleet.rollout.router.routing import loading, pick_replica
from rlfleet.rollout.types import GenerateRequest, GenerateResult, ReplicaState, ReplicaStatus

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
        self.janitor = Janitor(self, self.registry, config.router.janitor_interval_s)

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
            await self.registry.release(served_by)

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

    def queue(self, replica_id: str) -> WorkQueue:
        if replica_id not in self._queues:
            stream = self._keys.rollout_stream(replica_id)
            self._queues[replica_id] = WorkQueue(self._redis, self._keys, stream, ROLLOUT_GROUP)
        return self._queues[replica_id]

    def forget_queue(self, replica_id: str) -> None:
        self._queues.pop(replica_id, None)


def _unpack(result: Result) -> GenerateResult:
    """The stored answer, or the error it carries as an exception with the right status."""
    if result.ok:
        return GenerateResult.from_json(result.payload)
    if result.code is ErrorCode.INVALID_ARGUMENT:
        raise InvalidArgument(f"request {result.request_id}: {result.error}")
    raise Unavailable(f"request {result.request_id} failed on a replica: {result.error}")
