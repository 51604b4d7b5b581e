"""Rescue work queued on replicas that died or left, so every routed request is answered.

A request waits in its replica's stream until that replica answers it. If the replica is
SIGKILLed or stalled (its heartbeat lease lapses) or shuts down with a backlog (it deregisters
with entries still in its stream), nobody would ever read them; the janitor moves each entry to
an eligible replica, chosen like any new request. A move is one Lua step (the entry is in
exactly one stream at any instant), so a janitor killed mid-migration loses and duplicates
nothing, and the next sweep (of any router) finishes the job. A stalled replica that wakes up
cannot answer what was moved: its answers are fenced (``lease.py``). A router restart loses
nothing: every ``janitor_interval_s * SCAN_EVERY`` seconds, and at start, it also looks for
rollout streams of replicas that are not registered any more.

Several routers may run: a Redis lock (``SET NX PX``) lets one of them sweep at a time (an
efficiency only: concurrent moves stay correct). Every ``UPKEEP_S`` the sweeper also sets each
replica's in-flight count from the truth (the requests waiting in its stream), so counts left
behind by a killed router cannot stick, and trims each stream of entries all consumers are
done with. A
replica is forgotten (registry entry, draining mark and stream deleted) only after two
consecutive sweeps found its stream empty, which also catches a request routed to it in the
instant before it died. A replica registered as ``starting`` may be silent while its engine
loads: for ``routing.STARTUP_GRACE_S`` it is not declared dead (its stream is still emptied).

A drained request keeps its delivery count (``prior_deliveries``); one that has been delivered
``max_deliveries`` times already (say, a prompt that kills every replica it lands on) is
dead-lettered with an error answer instead of bounced on, so its caller hears why; so is an
entry that cannot be read (INVALID_ARGUMENT).

A packed entry (one replica's share of a ``GenerateBatch``) is moved like any other entry, as
a whole; the target is charged one in-flight request per member, which is what the router
that routed it releases once it is answered.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from rlfleet.common.errors import ErrorCode, Unavailable
from rlfleet.common.queue.backlog import Backlog
from rlfleet.common.queue.entries import Job
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaRegistry
from rlfleet.rollout.router.routing import loading
from rlfleet.rollout.types import entry_demand

log = logging.getLogger(__name__)

LOCK_TTL_MS = 5_000  # only saves work: moves are safe with several janitors at once
SCAN_EVERY = 30  # sweeps between scans for streams of unregistered replicas
UPKEEP_S = 2.0  # about how often in-flight counts are recounted and streams trimmed


class Routes(Protocol):
    """What the janitor needs of the router: per-replica queues and its choice of replica."""

    def queue(self, replica_id: str) -> Backlog: ...

    def forget_queue(self, replica_id: str) -> None: ...

    def choose(self, snap: RegistrySnapshot, min_version: int, sticky: str | None) -> str: ...


class Janitor:
    """Periodic sweeps over the registry; ``sweep()`` is one pass (tests call it directly)."""

    def __init__(
        self,
        core: Routes,
        registry: ReplicaRegistry,
        interval_s: float,
        on_migrated: Callable[[int], None] = lambda moved: None,
        move_delay_s: float = 0.0,
    ) -> None:
        self._core, self._registry, self._interval_s = core, registry, interval_s
        self._on_migrated = on_migrated  # told how many requests each sweep moved (metrics)
        self._move_delay_s = move_delay_s  # testing aid: a pause after each move
        self._token = uuid.uuid4().hex
        self._known: set[str] = set()  # registered at the previous sweep
        self._dead: set[str] = set()  # registered without heartbeat at the previous sweep
        self._waiting: dict[str, int] = {}  # requests left on a gone replica, last sweep
        self._why = ""  # why the last request could not be re-routed
        self._loading: set[str] = set()  # silent but "starting" lately: evacuated, not forgotten
        self._departed: set[str] = set()  # unregistered ids whose streams may hold work
        self._emptied: set[str] = set()  # ids whose stream the previous sweep found empty
        self._sweeps = 0
        self._upkeep_every = max(1, round(UPKEEP_S / max(interval_s, 1e-3)))
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
        upkeep = (self._sweeps - 1) % self._upkeep_every == 0  # the first sweep too
        if not (targets or upkeep):
            return 0
        if not await self._registry.lock_janitor(self._token, LOCK_TTL_MS):
            return 0
        try:
            moved = sum([await self._evacuate(replica_id) for replica_id in targets])
            if upkeep:
                await self._upkeep(registered)
            return moved
        finally:
            await self._registry.unlock_janitor(self._token)

    @property
    def sweeps(self) -> int:
        """Passes made so far (tests wait on it instead of sleeping)."""
        return self._sweeps

    async def _evacuate(self, replica_id: str) -> int:
        """Move every request queued on a gone replica, one entry at a time (``Backlog.move``
        is one step, so dying anywhere in here loses and duplicates nothing)."""
        queue, snap = self._core.queue(replica_id), await self._registry.snapshot()
        fates: Counter[str] = Counter()
        async for batch in queue.outstanding():
            for job in batch:
                fates[await self._rescue(snap, queue, job)] += 1
        if not fates:
            if replica_id in self._emptied and replica_id not in self._loading:
                await self._forget(replica_id)
            else:
                self._emptied.add(replica_id)
            return 0
        self._emptied.discard(replica_id)
        moved, waiting = fates["moved"], fates["waiting"]
        if moved or (waiting and self._waiting.get(replica_id) != waiting):  # not every sweep
            log.warning(
                "replica %s is gone: re-routed %d of its %d queued requests%s",
                replica_id,
                moved,
                sum(fates.values()),
                f"; {waiting} wait: {self._why}" if waiting else "",
            )
        self._waiting[replica_id] = waiting
        return moved

    async def _rescue(self, snap: RegistrySnapshot, queue: Backlog, job: Job) -> str:
        """One entry's fate: ``moved`` to a live replica, ``dead``-lettered with an answer
        (delivered ``max_deliveries`` times already, each delivery outlived by its replica;
        or unreadable), ``waiting`` for a replica (left in place), or ``gone`` meanwhile."""
        if job.deliveries >= queue.max_deliveries:
            why = (
                f"delivered {job.deliveries} times and never answered: each replica that "
                f"took it (the last, on {queue.stream}) died or lost its lease "
                "while holding it"
            )
            return "dead" if await queue.dead_letter(job, why, queued=True) else "gone"
        try:
            min_version, weight = entry_demand(job.payload)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            why, code = f"unreadable request: {exc}", ErrorCode.INVALID_ARGUMENT
            return "dead" if await queue.dead_letter(job, why, code, queued=True) else "gone"
        try:
            target = self._core.choose(snap, min_version, None)
        except Unavailable as exc:
            self._why = str(exc)
            return "waiting"
        if self._core.queue(target).stream == queue.stream:
            return "waiting"  # its heartbeat came back since the sweep began: leave it be
        if not await queue.move(job, self._core.queue(target)):
            return "gone"
        await self._registry.claim_many({target: weight}, {}, 0)
        snap.inflight[target] = snap.inflight.get(target, 0) + weight
        if self._move_delay_s > 0:
            await asyncio.sleep(self._move_delay_s)
        return "moved"

    async def _upkeep(self, registered: set[str]) -> None:
        """In-flight counts set from the truth (requests waiting in each stream), so counts
        left behind by a killed router or a moved request cannot stick; streams trimmed."""
        for replica_id in sorted(registered):
            queue = self._core.queue(replica_id)
            await queue.recount(self._registry.inflight_key, replica_id)
            await queue.trim()
        await self._registry.prune_counts()

    async def _forget(self, replica_id: str) -> None:
        """Delete what is left of a replica, unless it came back meanwhile (same id)."""
        if not await self._registry.remove(replica_id):
            return
        for tracked in (self._emptied, self._departed, self._known, self._dead):
            tracked.discard(replica_id)
        self._waiting.pop(replica_id, None)
        self._core.forget_queue(replica_id)
        log.info("forgot replica %s (gone, its stream stayed empty)", replica_id)
