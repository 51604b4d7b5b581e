"""Pushing the actor's weights to every rollout replica.

The trainer is the only writer of weights. After each update it hands the state dict and the
new version to a ``WeightTransport`` (``weight_transport``), which delivers it to every target
replica and reports, per replica, the version that replica now serves. A replica that fails to
take it stays at its old version, and the router's version gating keeps it out of the next
step. Replicas that join mid-run register at version 0; ``push(..., only_stale=True)`` sends
the current weights to them before they are routed to.

Which replicas exist comes from the router (``Router.ListReplicas``), never from Redis: the
registry is the rollout role's own business.

Replicas refuse a version that is not newer than theirs unless the push is forced. The first
push of a ``WeightSync`` is forced: a trainer that starts (or resumes from a checkpoint older
than what the replicas serve) is the only writer, and its weights win. A replica whose load
failed midway reports ``update_failed`` and stays a target until a push to it succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from rlfleet.common.errors import Unavailable
from rlfleet.rollout.types import ReplicaState, ReplicaStatus
from rlfleet.trainer.weight_broadcast import BroadcastResult, BroadcastWeightTransport
from rlfleet.trainer.weight_relay import RelayedResult, RelayWeightTransport
from rlfleet.trainer.weight_transport import (
    DeltaMode,
    GrpcWeightTransport,
    Prepared,
    PushResult,
    StateDict,
    WeightTransport,
)

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.5

TARGET_STATES = (ReplicaState.SERVING, ReplicaState.UPDATE_FAILED)
"""Replicas a push goes to: serving ones, and failed ones (a push is their retry)."""


class ReplicaDirectory(Protocol):
    """Who is out there: ``RolloutClient`` on the router's address answers this."""

    async def list_replicas(self) -> list[ReplicaStatus]: ...

    async def close(self) -> None: ...


class WeightSync:
    """The trainer's side: choose targets, push through the transport, report metrics."""

    def __init__(self, directory: ReplicaDirectory, transport: WeightTransport) -> None:
        self._directory = directory
        self._transport = transport
        self.versions: dict[str, int] = {}
        """Replica id -> the version it reported after our last push to it."""
        self._forced_once = False

    async def push(
        self,
        state_dict: StateDict,
        version: int,
        flush_cache: bool = True,
        only_stale: bool = False,
        force: bool | None = None,
    ) -> dict[str, float]:
        """Push ``version`` to live replicas (only those behind it, or failed, if
        ``only_stale``). ``force`` defaults to True for this object's first push only."""
        started = time.perf_counter()
        targets = await self._targets(version, only_stale)
        if not targets:  # nothing encoded: catch-up polls find nobody behind most of the time
            return {"weight_sync/replicas": 0.0}
        force = not self._forced_once if force is None else force
        prepared = await self._transport.prepare(state_dict, version, flush_cache, force, targets)
        results: list[PushResult] = []
        try:
            results = await self._transport.deliver(prepared, targets)
        finally:
            self._transport.release(prepared, bool(results) and _all_ok(results))
        return self._outcome(results, version, only_stale, started, prepared.delta_ratio)

    async def snapshot(
        self, state_dict: StateDict, version: int, flush_cache: bool = True
    ) -> EncodedSnapshot:
        """``version`` encoded now, into the payload replicas will read (shared memory on
        this host), so the actor may train on at once: the payload is the only copy."""
        force = not self._forced_once
        prepared = await self._transport.prepare(state_dict, version, flush_cache, force)
        return EncodedSnapshot(self, prepared)

    async def push_prepared(
        self, prepared: Prepared, only_stale: bool
    ) -> tuple[dict[str, float], bool]:
        """Deliver an encoded version to the live replicas (only those behind it, if
        ``only_stale``): its metrics, and whether no target failed."""
        started = time.perf_counter()
        targets = await self._targets(prepared.version, only_stale)
        results = await self._transport.deliver(prepared, targets) if targets else []
        metrics = self._outcome(
            results, prepared.version, only_stale, started, prepared.delta_ratio
        )
        return metrics, _all_ok(results)

    def release(self, prepared: Prepared, reusable: bool) -> None:
        self._transport.release(prepared, reusable)

    async def _targets(self, version: int, only_stale: bool) -> list[ReplicaStatus]:
        return [r for r in await self._live() if not only_stale or _behind(r, version)]

    def _outcome(
        self,
        results: list[PushResult],
        version: int,
        only_stale: bool,
        started: float,
        delta_ratio: float | None = None,
    ) -> dict[str, float]:
        """Record what each replica took; fail if a push for everyone reached no one."""
        if not results:
            return {"weight_sync/replicas": 0.0}
        self._record(results, version)
        accepted = [r for r in results if r.ok]
        if not accepted and not only_stale:
            raise Unavailable(f"no replica accepted weight version {version}")
        self._forced_once = self._forced_once or bool(accepted)
        metrics = push_metrics(results, delta_ratio)
        return {**metrics, "timing_s/update_weights": time.perf_counter() - started}

    def _record(self, results: list[PushResult], version: int) -> None:
        for result in results:
            self.versions[result.replica_id] = result.version
            if not result.ok:
                log.warning("weight push to %s failed: %s", result.replica_id, result.error)
            elif result.version != version:
                log.warning(
                    "replica %s answered version %d to a push of %d",
                    result.replica_id,
                    result.version,
                    version,
                )

    async def _live(self) -> list[ReplicaStatus]:
        """Alive, not drained, and serving (or waiting for a retry after a failed load)."""
        return [r for r in await self._directory.list_replicas() if r.state in TARGET_STATES]

    async def wait_for_replicas(self, count: int, timeout_s: float) -> list[ReplicaStatus]:
        """Block until ``count`` replicas are alive and serving (start-up); a router that is
        not up yet counts as no replica."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = await self._live_or_none()
            if len(live) >= count:
                return live
            if time.monotonic() > deadline:
                raise Unavailable(f"only {len(live)} of {count} rollout replicas came up")
            await asyncio.sleep(WAIT_POLL_S)

    async def _live_or_none(self) -> list[ReplicaStatus]:
        try:
            return await self._live()
        except (Unavailable, TimeoutError) as exc:
            log.info("router not reachable yet: %s", exc)
            return []

    async def close(self) -> None:
        await self._transport.close()
        await self._directory.close()


def grpc_weight_sync(
    router_address: str,
    api_key: str | None,
    max_message_mb: int,
    shared_memory: bool = True,
    delta: DeltaMode = "never",
    transport_kind: str = "auto",
    relay_fanout: int = 2,
    broadcast_timeout_s: float = 30.0,
) -> WeightSync:
    """Weight sync over gRPC: the router lists replicas, each gets its own stream (or, on this
    machine and with ``shared_memory``, a header naming one shared payload file; with
    ``transport_kind`` ``relay``, a tree of ``relay_fanout``; ``broadcast``, a
    ``torch.distributed`` group with ``broadcast_timeout_s``); ``delta`` is
    ``trainer.weight_delta``, ``transport_kind`` ``trainer.weight_transport``."""
    from rlfleet.rollout.client import PreparedUpdate, RolloutClient

    def connect(address: str) -> RolloutClient:
        return RolloutClient(address, api_key=api_key, max_message_mb=max_message_mb)

    chunk_bytes = min(4, max_message_mb // 2) * 2**20
    transport: GrpcWeightTransport
    if transport_kind == "relay":
        transport = RelayWeightTransport(connect, PreparedUpdate.of, chunk_bytes, relay_fanout)
    elif transport_kind == "broadcast":
        timeout = broadcast_timeout_s
        transport = BroadcastWeightTransport(connect, PreparedUpdate.of, chunk_bytes, timeout)
    else:
        shared = shared_memory and transport_kind != "stream"
        transport = GrpcWeightTransport(connect, PreparedUpdate.of, chunk_bytes, shared)
    transport.delta = delta
    return WeightSync(connect(router_address), transport)


class EncodedSnapshot:
    """One version encoded once (``WeightSync.snapshot``): pushed as often as retries need,
    then closed (its shared file kept for the next version if every replica took it)."""

    def __init__(self, sync: WeightSync, prepared: Prepared) -> None:
        self._sync, self._prepared = sync, prepared
        self._clean = True
        """No delivery failed at any target: the shared file may be written again."""

    async def push(self, only_stale: bool = False) -> dict[str, float]:
        clean_before, self._clean = self._clean, False  # one that raises may have reached some
        metrics, clean = await self._sync.push_prepared(self._prepared, only_stale)
        self._clean = clean_before and clean
        return metrics

    def close(self) -> None:
        self._sync.release(self._prepared, self._clean)


def _all_ok(results: Sequence[PushResult]) -> bool:
    """No target failed (one that did may still be reading the shared file)."""
    return all(r.ok for r in results)


def _behind(replica: ReplicaStatus, version: int) -> bool:
    return replica.weight_version < version or replica.state is ReplicaState.UPDATE_FAILED


def push_metrics(
    results: Sequence[PushResult], delta_ratio: float | None = None
) -> dict[str, float]:
    """Counts and sizes (verl-style names kept), the slowest and mean replica, and each
    replica's own time and megabytes (``weight_sync/<replica_id>/seconds``); ``weight/bytes_sent``
    is the payload bytes of what every replica took (a delta or the full push, summed over
    replicas), ``weight/delta_ratio`` the element delta's bytes over the full push's, for a push
    where one was measured (``trainer.weight_delta`` not ``never`` and a base to compare);
    ``weight/pause_s`` the longest a replica stopped taking work for it (each replica's own in
    ``weight/pause_s/<replica_id>``, as its reply reported it); ``weight/relay_fallbacks``, in
    a relay push, the replicas below a relay parent that the trainer pushed to straight;
    ``weight/broadcast_fallbacks``, in a broadcast push, the group's members it streamed to."""
    accepted = [r for r in results if r.ok]
    seconds = [r.seconds for r in accepted] or [0.0]
    metrics = {
        "weight_sync/replicas": float(len(accepted)),
        "weight_sync/failed": float(len(results) - len(accepted)),
        "weight_sync/mbytes": max((r.bytes for r in results), default=0) / 2**20,
        "weight_sync/push_s_max": max(seconds),
        "weight_sync/push_s_mean": sum(seconds) / len(seconds),
        "weight_sync/delta_replicas": float(sum(r.delta for r in accepted)),
        "weight/bytes_sent": float(sum(r.bytes for r in accepted)),
        "weight/pause_s": max((r.pause_s for r in accepted), default=0.0),
    }
    if delta_ratio is not None:
        metrics["weight/delta_ratio"] = delta_ratio
    relays = [r.relay for r in results if isinstance(r, RelayedResult)]
    if relays:  # a relay push: who the tree missed
        metrics["weight/relay_fallbacks"] = float(relays.count("fallback"))
    casts = [r.broadcast for r in results if isinstance(r, BroadcastResult)]
    if casts:  # a broadcast push: members the group did not deliver
        metrics["weight/broadcast_fallbacks"] = float(casts.count("fallback"))
    for r in results:
        metrics[f"weight_sync/{r.replica_id}/seconds"] = r.seconds
        metrics[f"weight_sync/{r.replica_id}/mbytes"] = r.bytes / 2**20
    for r in accepted:
        metrics[f"weight/pause_s/{r.replica_id}"] = r.pause_s
    return metrics
