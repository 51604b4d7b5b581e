"""Rescue work queued on replicas that died or left, so every routed request is answered.

A request waits in its replica's stream until that replica answers it. If the replica is
SIGKILLed (its heartbeat key expires) or shuts down with a backlog (it deregisters with entries
still in its stream), nobody would ever read them; the janitor drains such streams and queues
each request on an eligible replica, chosen like any new request. A router restart loses
nothing: every ``janitor_interval_s * SCAN_EVERY`` seconds, and at start, it also looks for
rollout streams of replicas that are not registered any more.

Several routers may run: a Redis lock (``SET NX PX``) lets one of them sweep at a time. A
replica is forgotten (registry entry, draining mark and stream deleted) only after two
consecutive sweeps found its stream empty, which also catches a request routed to it in the
instant before it died. A replica registered as ``starting`` may be silent while its engine
loads: for ``routing.STARTUP_GRACE_S`` it is not declared dead (its stream is still emptied).

A drained request keeps its delivery count (``prior_deliveries``); one that has been delivered
``max_deliveries`` times already (say, a prompt that kills every replica it lands on) is
dead-lettered with an error answer instead of bounced on, so its caller hears why.

A packed entry (one replica's share of a ``GenerateBatch``) is moved like any other entry, as
a whole; the target is charged one in-flight request per member, which is what the router
that routed it releases once it is answered.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Protocol

from rlfleet.common.errors import Unavailable
from rlfleet.common.workqueue import Job, WorkQueue
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaRegistry
from rlfleet.rollout.router.routing import loading
from rlfleet.rollout.types import entry_demand

log = logging.getLogger(__name__)

LOCK_TTL_MS = 30_000
SCAN_EVERY = 30  # sweeps between scans for streams of unregistered replicas


class Routes(Protocol):
    """What the janitor needs of the router: per-replica queues and its choice of replica."""

    def queue(self, replica_id: str) -> WorkQueue: ...

    def forget_queue(self, replica_id: str) -> None: ...

    def choose(self, snap: RegistrySnapshot, min_version: int, sticky: str | None) -> str: ...


class Janitor:
    """Periodic sweeps over the registry; ``sweep()`` is one pass (tests call it directly)."""

    def __init__(
        self, core: Routes, registry: ReplicaRegistry, interval_s: float,
        on_migrated: Callable[[int], None] = lambda moved: None,
    ) -> None:  # fmt: skip
        self._core, self._registry, self._interval_s = core, registry, interval_s
        self._on_migrated = on_migrated  # told how many requests each sweep moved (metrics)
        self._token = uuid.uuid4().hex
        self._known: set[str] = set()  # registered at the previous sweep
        self._dead: set[str] = set()  # registered without heartbeat at the previous sweep
        self._waiting: dict[str, int] = {}  # requests left on a gone replica, last sweep
        self._why = ""  # why the last request could not be re-routed
        self._loading: set[str] = set()  # silent but "starting" lately: evacuated, not forgotten
        self._departed: set[str] = set()  # unregistered ids whose streams may hold work
        self._emptied: set[str] = set()  # ids whose stream the previous sweep found empty
        self._sweeps = 0
        self._stopping = False
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="router-janitor")

    async def close(self) -> None:
        """Stop sweeping. A flag as well as cancel(): on Python 3.11 a cancellation can be
        swallowed by the ``asyncio.wait_for`` redis-py wraps around socket I/O."""
        self._stopping = True
        while self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task], timeout=0.1)
        self._task = None

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                self._on_migrated(await self.sweep())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep sweeping (e.g. Redis restarting)
                log.warning("janitor sweep failed, retrying in %.1fs: %s", self._interval_s, exc)
            await asyncio.sleep(self._interval_s)

    async def sweep(self) -> int:
        """One pass; returns how many requests were re-routed."""
        snap = await self._registry.snapshot()
        registered = {r.replica_id for r in snap.replicas}
        dead = {r.replica_id for r in snap.replicas if not r.alive}
        self._loading = {r.replica_id for r in snap.replicas if not r.alive and loading(r)}
        for replica_id in sorted(dead - self._dead - self._loading):
            log.warning("replica %s missed its heartbeat: treating it as dead", replica_id)
        self._dead = dead
        self._departed = (self._departed | (self._known - registered)) - registered
        if self._sweeps % SCAN_EVERY == 0:
            self._departed |= await self._registry.streams_without_replica(registered)
        self._known, self._sweeps = registered, self._sweeps + 1
        targets = sorted(dead | self._departed)
        self._emptied &= set(targets)
        if not targets or not await self._registry.lock_janitor(self._token, LOCK_TTL_MS):
            return 0
        try:
            return sum([await self._evacuate(replica_id) for replica_id in targets])
        finally:
            await self._registry.unlock_janitor(self._token)

    @property
    def sweeps(self) -> int:
        """Passes made so far (tests wait on it instead of sleeping)."""
        return self._sweeps

    async def _evacuate(self, replica_id: str) -> int:
        drained = await self._core.queue(replica_id).drain_jobs()
        if not drained:
            if replica_id in self._emptied and replica_id not in self._loading:
                await self._forget(replica_id)
            else:
                self._emptied.add(replica_id)
            return 0
        self._emptied.discard(replica_id)
        if not (jobs := await self._give_up_on_spent(replica_id, drained)):
            self._waiting.pop(replica_id, None)
            return 0
        snap = await self._registry.snapshot()
        moved = sum([await self._reroute(snap, replica_id, job) for job in jobs])
        waiting = len(jobs) - moved
        if moved or self._waiting.get(replica_id) != waiting:  # not every sweep while stuck
            log.warning(
                "replica %s is gone: re-routed %d of its %d queued requests%s",
                replica_id, moved, len(jobs),
                f"; {waiting} wait: {self._why}" if waiting else "",
            )  # fmt: skip
        self._waiting[replica_id] = waiting
        return moved

    async def _give_up_on_spent(self, gone_id: str, jobs: list[Job]) -> list[Job]:
        """Dead-letter the requests delivered ``max_deliveries`` times already (each delivery
        outlived by its replica), so their callers get an error; returns the others."""
        queue = self._core.queue(gone_id)
        for job in [job for job in jobs if job.deliveries >= queue.max_deliveries]:
            await queue.dead_letter(job, f"delivered {job.deliveries} times, replicas died")
        return [job for job in jobs if job.deliveries < queue.max_deliveries]

    async def _reroute(self, snap: RegistrySnapshot, gone_id: str, job: Job) -> int:
        """Queue one request on a live replica (1), or put it back to retry next sweep (0);
        either way with its delivery count, so a poison request still ends dead-lettered."""
        request_id, payload, prior = job.request_id, job.payload, job.deliveries
        try:
            min_version, weight = entry_demand(payload)
            target = self._core.choose(snap, min_version, None)
        except Unavailable as exc:
            self._why = str(exc)
            await self._core.queue(gone_id).submit(request_id, payload, prior_deliveries=prior)
            return 0
        except (ValueError, AttributeError, TypeError) as exc:
            log.warning("dropping unreadable request %s from %s: %s", request_id, gone_id, exc)
            return 0
        if await self._core.queue(target).submit(request_id, payload, prior_deliveries=prior):
            await self._registry.claim_many({target: weight}, {}, 0)
            snap.inflight[target] = snap.inflight.get(target, 0) + weight

        return 1

    async def _forget(self, replica_id: str) -> None:
        """Delete what is left of a replica, unless it came back meanwhile (same id)."""
        if not await self._registry.remove(replica_id):
            return
        for tracked in (self._emptied, self._departed, self._known, self._dead):
            tracked.discard(replica_id)
        self._waiting.pop(replica_id, None)
        self._core.forget_queue(replica_id)
        log.info("forgot replica %s (gone, its stream stayed empty)", replica_id)
