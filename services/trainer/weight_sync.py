"""Pushing the actor's weights to every rollout replica.

The trainer is the only writer of weights. After each update it encodes the state dict
once (header + payload, ``rlfleet.common.weights``) and streams it to all live replicas
in parallel. A replica that fails to take it stays at its old version, and the router's
version gating keeps it out of the next step. Replicas that join mid-run register at
version 0; ``catch_up`` pushes the current weights to them before they are routed to.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rlfleet.common import weights
from rlfleet.common.errors import Unavailable
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, registry: ReplicaRegistry, client_factory, chunk_bytes: int) -> None:
        self._registry = registry
        self._client_factory = client_factory
        self._clients: dict[str, object] = {}
        self._chunk_bytes = chunk_bytes

    def _client(self, address: str):
        if address not in self._clients:
            self._clients[address] = self._client_factory(address)
        return self._clients[address]

    async def _push_one(self, replica: ReplicaInfo, header, payload) -> bool:
        try:
            client = self._client(replica.address)
            await client.push_weights(header, payload, self._chunk_bytes)
            return True
        except Exception as exc:  # noqa: BLE001 - one bad replica must not stop training
            log.warning(
                "weight push to %s (%s) failed: %s", replica.replica_id, replica.address, exc
            )
            return False

    async def push(
        self, state_dict: dict, version: int, flush_cache: bool = True, only_stale: bool = False
    ) -> dict[str, float]:
        """Push ``version`` to live replicas (only those behind it if ``only_stale``)."""
        started = time.perf_counter()
        targets = [
            r for r in await self._registry.live() if not only_stale or r.weight_version < version
        ]
        if not targets:
            return {"weight_sync/replicas": 0.0}
        header, payload = weights.encode(state_dict, version, flush_cache)
        results = await asyncio.gather(*(self._push_one(r, header, payload) for r in targets))
        if not any(results) and not only_stale:
            raise Unavailable(f"no replica accepted weight version {version}")
        return {
            "weight_sync/replicas": float(sum(results)),
            "weight_sync/failed": float(len(results) - sum(results)),
            "weight_sync/mbytes": len(payload) / 2**20,
            "timing_s/update_weights": time.perf_counter() - started,
        }

    async def wait_for_replicas(self, count: int, timeout_s: float) -> list[ReplicaInfo]:
        """Block until ``count`` replicas are alive and serving (start-up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = await self._registry.live()
            if len(live) >= count:
                return live
            if time.monotonic() > deadline:
                raise Unavailable(f"only {len(live)} of {count} rollout replicas came up")
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
