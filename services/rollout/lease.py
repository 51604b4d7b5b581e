"""A replica's registry entry, its heartbeat lease, and the two ways its process ends itself.

Leases fence answers: the heartbeat key holds a token new to each registration, and an answer
is stored only while the key still holds ours and the entry is still in our stream (one Lua
step, ``WorkQueue.fence``). A replica stalled past ``heartbeat_ttl_s`` (SIGSTOP, a long GC)
has lost its lease, and the janitor may have moved its work: its late answers are discarded,
and at its next beat it drops the jobs it held, registers again with a new token and re-reads
whatever of its stream is still there. Nothing it held is lost: what was moved is answered
where it went, the rest is read again here. The re-read does not count as a delivery (the
replica gives it back, ``Consumer.forgive``), unless the lease lapsed because the event loop
hung (``HeartbeatThread.held_back``: the work may be what hangs it), so a replica stopped
again and again does not dead-letter sound requests. A registration that fails (Redis away)
is tried again at every interval until one holds, dropping what was read meanwhile.

Renewals run in a thread of their own (``heartbeat.py``), from the first registration on, so
a busy event loop or a loading engine does not lose the lease; a lapse the thread finds is
handled here, on the loop. The loop beats itself at every change of state, so routers see it
at once. This loop also ends the process: when the engine dies it stops beating and sets
``failed`` (the TTL lapses, the janitor moves the unanswered entries); when a router drained
the replica (``DrainReplica``) and nothing is left to answer, it sets ``drained``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.heartbeat import HeartbeatThread
from rlfleet.rollout.inflight import InFlight
from rlfleet.rollout.job_loop import HeldJobs
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry

log = logging.getLogger(__name__)


class Lease:
    """Registers, renews and re-takes the replica's lease; watches for death and drain."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        queue: WorkQueue,
        replica_id: str,
        inflight: InFlight,
        held_jobs: HeldJobs,
        describe: Callable[[], ReplicaInfo],
        pulse: HeartbeatThread,
    ) -> None:
        self.registry, self.queue, self.replica_id = registry, queue, replica_id
        self._inflight, self._held_jobs, self._describe = inflight, held_jobs, describe
        self._pulse = pulse  # renews the lease from its own thread once we hold one
        self._pulsing = False
        self._lapsed = asyncio.Event()  # set (on the loop) when the thread found it lapsed
        self._token = ""  # our token in the heartbeat key; "" until the first registration
        self._relapsed = False  # lost a lease and not registered again yet: drop what we hold
        self._last_beat = 0.0  # time.time() of the last successful beat on the loop
        self._renewed = False  # a lease renewed once: the engine has started, beats are due
        self.failed = asyncio.Event()  # the engine died: stop, let the heartbeat TTL lapse
        self.drained = asyncio.Event()  # a router drained us and our work is done: exit

    @property
    def last_beat(self) -> float:
        """time.time() of the last successful beat, loop's or thread's; 0 = none yet."""
        return max(self._last_beat, self._pulse.last_beat)

    @property
    def held(self) -> bool:
        """True once registered, until a lapse is noticed (then jobs are not retried)."""
        return bool(self._token)

    async def beat(self) -> None:
        """Renew our lease with the whole entry; if it lapsed, drop the jobs we held and
        register again under a new lease (re-adding the entry if a janitor removed it)."""
        info = self._describe()
        try:
            if not self._token or not await self.registry.renew(info, self._token):
                await self._relet(info)
            else:
                self._renewed = True
                self._pulse.hand(self._token)  # the thread may have let it go meanwhile
            self._last_beat = time.time()
        except Exception as exc:  # noqa: BLE001 - a missed beat is retried next interval
            log.warning("heartbeat for %s failed: %s", self.replica_id, exc)

    async def _relet(self, info: ReplicaInfo) -> None:
        """Take a new lease. After a lapse (not at start): our work may have moved, so the jobs
        we hold are dropped (``_drop_held``), again at each try until a registration holds
        (jobs read meanwhile would be fenced)."""
        if self._token:  # expected while the engine started (no beats then): not a warning
            level = logging.WARNING if self._renewed else logging.DEBUG
            log.log(
                level,
                "replica %s lost its lease (no heartbeat for %.1f s): dropping %d jobs "
                "and registering again",
                self.replica_id,
                time.time() - self.last_beat,
                len(self._inflight.jobs()),
            )
            self._token, self._relapsed = "", True  # cancelled jobs are not queued for a retry
        if self._relapsed:
            await self._drop_held()
        token = uuid.uuid4().hex
        self.queue.fence = (self.registry.lease_key(self.replica_id), token)
        await self.registry.register(info, token)
        self._token, self._relapsed = token, False
        self._pulse.hand(token)
        if not self._pulsing:  # from the first registration on, the engine loading too
            self._pulse.start(token, self._lapsed.set)
            self._pulsing = True

    async def _drop_held(self) -> None:
        """Cancel and forget every job we hold (their answers would be fenced), and have the
        next read start again with whatever of our stream is still pending for us (what the
        janitor did not move). Unless the loop hung, the dropped jobs get their delivery back
        first: the lapse was not their doing."""
        held = [*self._inflight.jobs().values(), *self._held_jobs.all()]
        if held and not self._pulse.held_back:
            try:
                await self.queue.forgive(self.replica_id, held)
            except Exception as exc:  # noqa: BLE001 - then the re-read counts, nothing worse
                log.warning("could not give back the deliveries of %d jobs: %s", len(held), exc)
        await self._inflight.cancel_jobs()
        self._held_jobs.clear()
        self.queue.replay(self.replica_id)

    async def run(self, engine: Engine, interval_s: float) -> None:
        """While the engine lives: show the heartbeat thread the loop is alive, re-take a
        lease it found lapsed (or retry a registration that failed), check for drain, every
        ``interval_s``; then set ``failed``."""
        while engine.is_alive():
            self._pulse.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lapsed.wait(), interval_s)
            if self._lapsed.is_set() or not self._token:  # or a registration failed
                self._lapsed.clear()
                await self.beat()  # finds the lease gone: drops our jobs, registers again
            await self._check_drained()
        log.error("%s engine died; %s stops heartbeating", engine.name, self.replica_id)
        self._pulse.stop()
        self.failed.set()

    async def _check_drained(self) -> None:
        """Drained by a router (``DrainReplica``): keep answering what is queued here, and
        once nothing is left (running, to retry, or in our stream) set ``drained`` so the
        process deregisters and exits 0."""
        if self.drained.is_set() or len(self._inflight) or self._held_jobs:
            return
        try:
            if not await self.registry.is_draining(self.replica_id) or await self.queue.length():
                return
        except Exception as exc:  # noqa: BLE001 - checked again at the next beat
            log.warning("checking whether %s is drained failed: %s", self.replica_id, exc)
            return
        log.info("replica %s is drained and has no work left: exiting", self.replica_id)
        self.drained.set()

    async def leave(self) -> None:
        """Stop the heartbeat thread, then deregister (best effort: the TTL ends the entry
        anyway)."""
        await asyncio.to_thread(self._pulse.stop)
        with contextlib.suppress(Exception):
            await self.registry.deregister(self.replica_id)
