"""The lease heartbeat, in a thread of its own with its own Redis connection.

Why not on the replica's event loop: anything that holds the loop for longer than
``heartbeat_ttl_s`` (tokenizing a long prompt, vLLM building its engine, a slow callback)
would let the lease lapse, the janitor would move the replica's work and the replica would
drop everything it holds, though nothing was wrong. Here the renewals go on whatever the loop
does, from the moment the replica first registers (so a loading engine keeps its lease too).

The thread only renews (``ReplicaRegistry.renew``, the same one-step script the loop uses).
Everything that changes the replica's own state stays on the loop: when a renewal finds the
lease gone, the thread stops renewing and tells the loop (``lapsed``), which drops its jobs
and registers again (``lease.py``), then hands the thread the new token.

A loop that is hung for good must still lose its lease, or its work would never move: once
serving, the loop marks itself alive (``tick``) at every interval, and past
``rollout.loop_stall_s`` without a mark the thread stops renewing. SIGSTOP stops the thread
with the loop, so a stopped replica still lapses as before. ``held_back`` tells the two kinds
of lapse apart: a hung loop may be the work's doing (a poison request), so the jobs it drops
keep their delivery; a stopped process or a lost key is not, so they get it back (``lease.py``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from redis.asyncio import ConnectionPool, Redis

from rlfleet.common.keys import Keys
from rlfleet.common.redis_client import OutageRetry
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry

log = logging.getLogger(__name__)


class HeartbeatThread:
    """Renews one lease every ``interval_s`` from a daemon thread; see the module docstring."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        ttl_s: float,
        interval_s: float,
        stall_s: float,
        describe: Callable[[], ReplicaInfo],
    ) -> None:
        self._pool_kwargs = _pool_settings(redis, interval_s)  # a connection of our own
        self._keys, self._ttl_s, self._interval_s = keys, ttl_s, interval_s
        self._stall_s, self._describe = stall_s, describe
        self._token = ""  # the lease we renew; "" while the loop takes a new one
        self._guarded = False  # serving: a loop silent past stall_s is taken as hung
        self._tick = time.monotonic()  # the loop's last sign of life
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_lapse: Callable[[], object] = lambda: None
        self.last_beat = 0.0  # time.time() of the last renewal that held
        self.stalled = False  # the thread stopped renewing because the loop looked hung
        self.held_back = False  # renewals of the current lease were withheld (loop hung)

    def start(self, token: str, on_lapse: Callable[[], None]) -> None:
        """Start renewing ``token``; ``on_lapse`` runs on the caller's loop when it lapses."""
        loop = asyncio.get_running_loop()
        self._on_lapse = lambda: loop.call_soon_threadsafe(on_lapse)
        self._token = token
        self._thread = threading.Thread(target=self._main, name="rlfleet-heartbeat", daemon=True)
        self._thread.start()

    def hand(self, token: str) -> None:
        """The lease to renew from now on (after the loop registered again)."""
        if token != self._token:
            self.held_back = False
        self._token = token

    def tick(self) -> None:
        """The loop is alive (called by the loop); from the first tick the stall guard holds."""
        self._tick, self._guarded = time.monotonic(), True

    def stop(self) -> None:
        """Stop renewing and wait for the thread (a renewal under way finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval_s + 5.0)
        self._thread = None

    def _main(self) -> None:
        asyncio.run(self._renew_until_stopped())

    async def _renew_until_stopped(self) -> None:
        redis = Redis(connection_pool=ConnectionPool(**self._pool_kwargs))
        registry = ReplicaRegistry(redis, self._keys, self._ttl_s)
        try:
            while not self._stop.wait(self._interval_s):
                await self._renew(registry)
        finally:
            await redis.aclose()

    async def _renew(self, registry: ReplicaRegistry) -> None:
        token = self._token
        if not token:
            return
        if self._loop_hung():
            self.held_back = True  # a lapse of this lease is then the loop's doing
            return
        try:
            held = await registry.renew(self._describe(), token)
        except Exception as exc:  # noqa: BLE001 - retried at the next interval
            log.warning("heartbeat (thread) failed: %s", exc)
            return
        if held:
            self.last_beat, self.held_back = time.time(), False  # the hang did not cost it
        elif token == self._token:  # not handed a new one meanwhile: the loop must re-take it
            self._token = ""
            self._on_lapse()

    def _loop_hung(self) -> bool:
        silent = time.monotonic() - self._tick
        hung = self._guarded and silent > self._stall_s
        if hung and not self.stalled:
            log.error(
                "the event loop has not answered for %.0f s (rollout.loop_stall_s %.0f): "
                "no more heartbeats, the lease will lapse",
                silent,
                self._stall_s,
            )
        self.stalled = hung
        return hung


def _pool_settings(redis: Redis, interval_s: float) -> dict:
    """The client's connection settings (address, TLS, password), retrying for at most one
    interval: a renewal that cannot get through is simply tried again at the next."""
    pool = redis.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs["retry"] = OutageRetry(interval_s)
    return {"connection_class": pool.connection_class, "max_connections": 2, **kwargs}
