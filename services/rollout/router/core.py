"""The router's core: pick a replica, queue the request on its stream, return the answer.

Why the state lives in Redis (registry, sticky map, in-flight counts, draining set): several
routers can run side by side and agree on load and affinity, and a restarted router loses
nothing. Why requests go through each replica's own stream rather than a direct RPC: a replica
that dies mid-request leaves its work in the stream, and the janitor here hands that work to a
live replica (``janitor.py``), so the caller still gets its answer (request ids make the
answer unique). Every read and write of that state goes through ``ReplicaRegistry``, but
for the one Lua step that places and queues a single Generate (``enqueue.py``).

``RouterCore`` assembles the parts and serves the fleet view:

- ``request_path.RequestPath``: one Generate, three round trips (enqueue, the wake-up that
  carries the answer, and the release of its in-flight count after the answer has gone back),
  routed from a registry copy at most ``SNAPSHOT_MAX_AGE_S`` old;
- ``batch_path.BatchPath``: a GenerateBatch, one queue entry per replica (``batch.py``);
- ``janitor.Janitor``: moves the work of dead or departed replicas, using this core's
  per-replica queues and its choice of replica (``choose``);
- ``list_replicas``, ``drain_replica``, ``scrape_metrics``, ``serving_version``: the fleet as
  ``Router`` (and the OpenAI front's model card) shows it.

Every call is counted and timed in ``metrics`` (Prometheus; ``metrics.py``), whichever front
door (gRPC ``server.py``, the OpenAI front of ``rlfleet.rollout.gateway``) it came through.

No grpc here: ``server.py`` converts protobuf to the plain objects in ``types.py``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.errors import NotFound
from rlfleet.common.keys import ROLLOUT_GROUP, Keys
from rlfleet.common.queue.answers import Answers
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.rollout.limits import PromptLimits
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router.batch_path import BatchPath
from rlfleet.rollout.router.enqueue import Enqueuer, SnapshotCache
from rlfleet.rollout.router.janitor import Janitor
from rlfleet.rollout.router.metrics import RouterMetrics
from rlfleet.rollout.router.request_path import RequestPath
from rlfleet.rollout.router.routing import RoundRobin, loading, pick_replica
from rlfleet.rollout.types import GenerateRequest, GenerateResult, ReplicaState, ReplicaStatus

log = logging.getLogger(__name__)

GROUP = ROLLOUT_GROUP
SNAPSHOT_MAX_AGE_S = 0.25
"""How old a registry read a routing decision may use (``enqueue.SnapshotCache``): the Lua
step re-checks the pick's state, version, drain mark and queue live, so an old copy costs a
retry, not a wrong placement."""


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
        return ReplicaStatus(
            info.replica_id,
            info.address,
            info.weight_version,
            self.state,
            self.in_flight,
            info.backend,
            info.served,
            info.heartbeat_age_s,
        )


class RouterCore:
    """Routes GenerateRequests to replicas; ``start()`` runs the dead-replica janitor."""

    def __init__(
        self, redis: Redis, keys: Keys, config: RlfleetConfig, rng: random.Random | None = None
    ) -> None:
        self._redis, self._keys, self._cfg = redis, keys, config.router
        self._limits = PromptLimits.of(config.rollout)  # refused here, before any queue
        self.registry = ReplicaRegistry(redis, keys, config.rollout.heartbeat_ttl_s)
        self._snapshots = SnapshotCache(self.registry, SNAPSHOT_MAX_AGE_S)
        self._queues: dict[str, WorkQueue] = {}
        self.answers = Answers(redis, keys)  # answers, bindings, waiters: no stream of their own
        self._rng = rng or random.Random()
        self._round_robin = RoundRobin() if config.router.policy == "round_robin" else None
        self.metrics = RouterMetrics()
        enqueuer = Enqueuer(redis, keys)
        self._single = RequestPath(
            self._cfg,
            self.registry,
            self._snapshots,
            enqueuer,
            self._rng,
            self._round_robin,
            self.answers,
        )
        self._batch = BatchPath(
            self._cfg, self.registry, self._rng, self._round_robin, self.queue, self.answers
        )
        self.janitor = Janitor(
            self,
            self.registry,
            config.router.janitor_interval_s,
            self.metrics.migrated,
            config.router.debug_move_delay_s,
        )

    def start(self) -> None:
        """Start the janitor that rescues work queued on dead or departed replicas."""
        self.janitor.start()

    async def close(self) -> None:
        await self.janitor.close()
        await self._single.close()

    # ---- generation --------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Answer one request (idempotent on ``request_id``; ``request_path.py``)."""
        with self.metrics.track("generate"):
            self._limits.check(request)
            return await self._single.generate(request)

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Answer many requests, in order, with one queue entry per replica and a few round
        trips in all (``batch_path.py``). Idempotent per request id, like ``generate``; the
        first failure in request order fails the call (as a gather of ``generate`` calls
        would)."""
        with self.metrics.track("generate_batch", max(1, len(requests))):
            self._limits.check_all(requests)
            return await self._batch.generate_batch(requests)

    def choose(self, snap: RegistrySnapshot, min_version: int, sticky: str | None) -> str:
        """The replica a request goes to, by the routing policy (the janitor's moves)."""
        if self._round_robin is not None:
            return self._round_robin.pick(snap.replicas, min_version, snap.draining)
        cap = self._cfg.max_inflight_per_replica
        args = (snap.inflight, sticky, min_version, cap, snap.draining, self._rng)
        return pick_replica(snap.replicas, *args)

    # ---- replicas ----------------------------------------------------------------------

    async def list_replicas(self) -> list[ReplicaView]:
        snap = await self.registry.snapshot()
        self._snapshots.put(snap)
        return [
            ReplicaView(r, snap.inflight.get(r.replica_id, 0), r.replica_id in snap.draining)
            for r in snap.replicas
        ]

    async def serving_version(self) -> int:
        """The newest weight version a serving replica holds (-1: none serves)."""
        views = await self.list_replicas()
        return max(
            (v.info.weight_version for v in views if v.state is ReplicaState.SERVING), default=-1
        )

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
        self.metrics.set_replicas(
            (v.info.replica_id, v.in_flight, v.info.weight_version) for v in views
        )
        return self.metrics.render()

    # ---- per-replica queues ------------------------------------------------------------

    def queue(self, replica_id: str) -> WorkQueue:
        """The work queue of one replica's stream (one object per replica, kept)."""
        if replica_id not in self._queues:
            stream = self._keys.rollout_stream(replica_id)
            self._queues[replica_id] = WorkQueue(self._redis, self._keys, stream, ROLLOUT_GROUP)
        return self._queues[replica_id]

    def forget_queue(self, replica_id: str) -> None:
        self._queues.pop(replica_id, None)
