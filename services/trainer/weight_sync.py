"""Pushing the actor's weights to every rollout replica.

The trainer is the only writer of weights. After each update it hands the state dict and the
new version to a ``WeightTransport``, which delivers it to every target replica and reports,
per replica, the version that replica now serves (the reply to the push, so no second look-up).
A replica that fails to take it stays at its old version, and the router's version gating keeps
it out of the next step. Replicas that join mid-run register at version 0; ``push(...,
only_stale=True)`` sends the current weights to them before they are routed to.

Which replicas exist comes from the router (``Router.ListReplicas``), never from Redis: the
registry is the rollout role's own business. ``GrpcWeightTransport`` streams the encoded weights
over ``Rollout.UpdateWeights``; other transports (shared memory, NCCL) fit the same Protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rlfleet.common import weights
from rlfleet.common.errors import Unavailable
from rlfleet.rollout.types import ReplicaState, ReplicaStatus, UpdateOutcome

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

WAIT_POLL_S = 0.5

StateDict = Mapping[str, "torch.Tensor"]  # parameter name -> tensor


@dataclass
class PushResult:
    """What one replica made of one push."""

    replica_id: str
    ok: bool
    version: int = 0
    """The version the replica reports serving after the push (its reply)."""
    seconds: float = 0.0
    bytes: int = 0
    error: str = ""


class ReplicaDirectory(Protocol):
    """Who is out there: ``RolloutClient`` on the router's address answers this."""

    async def list_replicas(self) -> list[ReplicaStatus]: ...

    async def close(self) -> None: ...


class WeightTransport(Protocol):
    """Delivers one version of the weights to replicas; one result per target, in order."""

    async def push(
        self, state_dict: StateDict, version: int, flush_cache: bool,
        targets: Sequence[ReplicaStatus],
    ) -> list[PushResult]: ...  # fmt: skip

    async def close(self) -> None: ...


class WeightReceiver(Protocol):
    """One replica's end of the gRPC transport (``RolloutClient``)."""

    async def push_weights(
        self, header: weights.WeightHeader, payload: bytes, chunk_bytes: int
    ) -> UpdateOutcome: ...

    async def close(self) -> None: ...


class GrpcWeightTransport:
    """Encode once, stream to every target in parallel over ``Rollout.UpdateWeights``."""

    def __init__(self, connect: Callable[[str], WeightReceiver], chunk_bytes: int) -> None:
        self._connect = connect
        self._clients: dict[str, WeightReceiver] = {}
        self._chunk_bytes = chunk_bytes

    async def push(
        self, state_dict: StateDict, version: int, flush_cache: bool,
        targets: Sequence[ReplicaStatus],
    ) -> list[PushResult]:  # fmt: skip
        header, payload = weights.encode(dict(state_dict), version, flush_cache)
        return list(await asyncio.gather(*(self._push_one(t, header, payload) for t in targets)))

    async def _push_one(
        self, target: ReplicaStatus, header: weights.WeightHeader, payload: bytes
    ) -> PushResult:
        started = time.perf_counter()
        try:
            client = self._client(target.address)
            outcome = await client.push_weights(header, payload, self._chunk_bytes)
        except Exception as exc:  # noqa: BLE001 - one bad replica must not stop training
            error = f"{type(exc).__name__}: {exc}"
            return PushResult(target.replica_id, False, target.weight_version, error=error)
        seconds = time.perf_counter() - started
        return PushResult(target.replica_id, True, outcome.version, seconds, len(payload))

    def _client(self, address: str) -> WeightReceiver:
        if address not in self._clients:
            self._clients[address] = self._connect(address)
        return self._clients[address]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


class WeightSync:
    """The trainer's side: choose targets, push through the transport, report metrics."""

    def __init__(self, directory: ReplicaDirectory, transport: WeightTransport) -> None:
        self._directory = directory
        self._transport = transport
        self.versions: dict[str, int] = {}
        """Replica id -> the version it reported after our last push to it."""

    async def push(
        self, state_dict: StateDict, version: int, flush_cache: bool = True,
        only_stale: bool = False,
    ) -> dict[str, float]:  # fmt: skip
        """Push ``version`` to live replicas (only those behind it if ``only_stale``)."""
        started = time.perf_counter()
        targets = [r for r in await self._live() if not only_stale or r.weight_version < version]
        if not targets:
            return {"weight_sync/replicas": 0.0}
        results = await self._transport.push(state_dict, version, flush_cache, targets)
        self._record(results, version)
        accepted = [r for r in results if r.ok]
        if not accepted and not only_stale:
            raise Unavailable(f"no replica accepted weight version {version}")
        return {
            "weight_sync/replicas": float(len(accepted)),
            "weight_sync/failed": float(len(results) - len(accepted)),
            "weight_sync/mbytes": max((r.bytes for r in results), default=0) / 2**20,
            "timing_s/update_weights": time.perf_counter() - started,
        }

    def _record(self, results: list[PushResult], version: int) -> None:
        for result in results:
            self.versions[result.replica_id] = result.version
            if not result.ok:
                log.warning("weight push to %s failed: %s", result.replica_id, result.error)
            elif result.version != version:
                log.warning("replica %s answered version %d to a push of %d",
                            result.replica_id, result.version, version)  # fmt: skip

    async def _live(self) -> list[ReplicaStatus]:
        """Alive, serving and not drained: what the router would route to (at some version)."""
        return [r for r in await self._directory.list_replicas() if r.state is ReplicaState.SERVING]

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


def grpc_weight_sync(router_address: str, api_key: str | None, max_message_mb: int) -> WeightSync:
    """Weight sync over gRPC: the router lists replicas, each gets its own stream."""
    from rlfleet.rollout.client import RolloutClient

    def connect(address: str) -> RolloutClient:
        return RolloutClient(address, api_key=api_key, max_message_mb=max_message_mb)

    chunk_bytes = min(4, max_message_mb // 2) * 2**20
    return WeightSync(connect(router_address), GrpcWeightTransport(connect, chunk_bytes))
