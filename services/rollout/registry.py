"""The replica registry in Redis: who is out there, at which weight version, and alive?

A replica writes its hash (address, version, state) and refreshes a heartbeat key with a
TTL; membership lives in a set. Routers and the trainer read it. A replica whose
heartbeat key has expired is dead, whatever its hash says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rlfleet.common.keys import Keys


@dataclass
class ReplicaInfo:
    replica_id: str
    address: str
    weight_version: int = 0
    state: str = "starting"
    backend: str = ""
    served: int = 0
    heartbeat_at: float = 0.0
    alive: bool = False

    @property
    def heartbeat_age_s(self) -> float:
        return max(0.0, time.time() - self.heartbeat_at) if self.heartbeat_at else -1.0

    def to_hash(self) -> dict[str, str]:
        return {
            "address": self.address,
            "weight_version": str(self.weight_version),
            "state": self.state,
            "backend": self.backend,
            "served": str(self.served),
            "heartbeat_at": str(self.heartbeat_at),
        }

    @classmethod
    def from_hash(cls, replica_id: str, raw: dict, alive: bool) -> ReplicaInfo:
        text = {_s(k): _s(v) for k, v in raw.items()}
        return cls(
            replica_id=replica_id,
            address=text.get("address", ""),
            weight_version=int(text.get("weight_version", 0)),
            state=text.get("state", "unknown"),
            backend=text.get("backend", ""),
            served=int(text.get("served", 0)),
            heartbeat_at=float(text.get("heartbeat_at", 0.0)),
            alive=alive,
        )


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ReplicaRegistry:
    """Reads and writes replica entries; ``redis`` is a ``redis.asyncio.Redis``."""

    def __init__(self, redis, keys: Keys, heartbeat_ttl_s: float = 5.0) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_ms = int(heartbeat_ttl_s * 1000)

    async def register(self, info: ReplicaInfo) -> None:
        info.heartbeat_at = time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.replica(info.replica_id), mapping=info.to_hash())
            pipe.sadd(self._keys.replicas, info.replica_id)
            pipe.set(self._keys.heartbeat(info.replica_id), "1", px=self._ttl_ms)
            await pipe.execute()

    async def heartbeat(self, replica_id: str, **fields) -> None:
        """Refresh liveness and optionally update fields (state, weight_version, served)."""
        mapping = {k: str(v) for k, v in fields.items()}
        mapping["heartbeat_at"] = str(time.time())
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.replica(replica_id), mapping=mapping)
            pipe.set(self._keys.heartbeat(replica_id), "1", px=self._ttl_ms)
            await pipe.execute()

    async def deregister(self, replica_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.srem(self._keys.replicas, replica_id)
            pipe.delete(self._keys.replica(replica_id), self._keys.heartbeat(replica_id))
            pipe.hdel(self._keys.inflight, replica_id)
            await pipe.execute()

    async def get(self, replica_id: str) -> ReplicaInfo | None:
        raw = await self._redis.hgetall(self._keys.replica(replica_id))
        if not raw:
            return None
        alive = bool(await self._redis.exists(self._keys.heartbeat(replica_id)))
        return ReplicaInfo.from_hash(replica_id, raw, alive)

    async def list(self) -> list[ReplicaInfo]:
        """Every registered replica, alive or not, sorted by id."""
        ids = sorted(_s(i) for i in await self._redis.smembers(self._keys.replicas))
        infos = [await self.get(replica_id) for replica_id in ids]
        return [info for info in infos if info is not None]

    async def live(self, min_version: int = 0) -> list[ReplicaInfo]:
        """Alive replicas that are serving at ``min_version`` or newer."""
        return [
            r
            for r in await self.list()
            if r.alive and r.state == "serving" and r.weight_version >= min_version
        ]
