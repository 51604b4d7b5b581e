"""The replica registry in Redis: who is out there, at which weight version, alive, and loaded?

A replica writes its hash (address, version, state) and refreshes a heartbeat key with a
TTL; membership lives in a set. A replica whose heartbeat key has expired is dead, whatever
its hash says. Routers add what they share with each other: in-flight counts, the sticky map
and the draining set.

This class is the only code that touches those keys (besides the router's one-step enqueue,
``router/enqueue.py``, which reads and counts in the same step that queues), and it is
private to the rollout role: replicas and routers use it; everyone else (trainer, ``rlfleet
status``) asks a router over ``Router.ListReplicas``, so the key layout can change without
them noticing.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from rlfleet.common.keys import HEARTBEAT_SUFFIX, Keys
from rlfleet.rollout.types import ReplicaState

# Everything a routing decision needs, in one round trip: the member ids, each member's hash
# and heartbeat, the in-flight counts, the draining set and (if asked) sessions' sticky ids.
# Per-replica key names are prefix .. id (.. suffix), as ``Keys`` builds them.
_SNAPSHOT_LUA = """
local ids = redis.call('SMEMBERS', KEYS[1])
local hashes, alive = {}, {}
for i, id in ipairs(ids) do
  hashes[i] = redis.call('HGETALL', ARGV[1] .. id)
  alive[i] = redis.call('EXISTS', ARGV[1] .. id .. ARGV[2])
end
local sticky = {}
for i = 4, #KEYS do sticky[i - 3] = redis.call('GET', KEYS[i]) or '' end
return {ids, hashes, alive, redis.call('HGETALL', KEYS[2]), redis.call('SMEMBERS', KEYS[3]), sticky}
"""

# Undo a decrement that went below zero (a replica deregistered meanwhile has no field, a
# recount may have set it lower): the field goes, as an unregistered or idle replica's does.
_UNDERFLOW_LUA = """
if tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') < 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# Drop the counts (KEYS[1]) of ids that are not members (KEYS[2]) now.
_PRUNE_LUA = """
for _, id in ipairs(redis.call('HKEYS', KEYS[1])) do
  if redis.call('SISMEMBER', KEYS[2], id) == 0 then redis.call('HDEL', KEYS[1], id) end
end
return 0
"""

# Decrement several counts (ARGV: id, n, id, n, ...), each never below zero.
_RELEASE_MANY_LUA = """
for i = 1, #ARGV, 2 do
  local n = math.min(tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0'), tonumber(ARGV[i + 1]))
  if n > 0 then redis.call('HINCRBY', KEYS[1], ARGV[i], -n) end
end
return 1
"""

# Release the janitor lock only if we still hold it (it may have expired and been retaken).
_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Renew a lease only while it is ours: KEYS heartbeat, replica hash, member set; ARGV token,
# ttl ms, id, then hash field/value pairs. 0 when the lease lapsed (or another took it).
_RENEW_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
redis.call('SADD', KEYS[3], ARGV[3])
return 1
"""

# Forget a replica unless its heartbeat came back meanwhile (same id, restarted).
_REMOVE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('DEL', KEYS[5], KEYS[6])
return 1
"""


@dataclass
class ReplicaInfo:
    replica_id: str
    address: str
    weight_version: int = 0
    state: ReplicaState = ReplicaState.STARTING
    backend: str = ""
    served: int = 0
    heartbeat_at: float = 0.0
    alive: bool = False

    @property
    def heartbeat_age_s(self) -> float:
        return max(0.0, time.time() - self.heartbeat_at) if self.heartbeat_at else -1.0

    def to_hash(self) -> dict[FieldT, EncodableT]:
        """The replica's Redis hash, as ``HSET ... mapping=`` takes it (every value text)."""
        return {
            "address": self.address,
            "weight_version": str(self.weight_version),
            "state": str(self.state),
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
            state=ReplicaState.parse(text.get("state", "unknown")),
            backend=text.get("backend", ""),
            served=int(text.get("served", 0)),
            heartbeat_at=float(text.get("heartbeat_at", 0.0)),
            alive=alive,
        )


@dataclass
class RegistrySnapshot:
    """Routing state as one consistent read: replicas (sorted by id), load, drains, sticky."""

    replicas: list[ReplicaInfo]
    inflight: dict[str, int] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)
    sticky: str | None = None
    stickies: dict[str, str] = field(default_factory=dict)  # session -> replica, when asked


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(flat: list) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}


class ReplicaRegistry:
    """Reads and writes replica entries and the routers' shared counters."""

    def __init__(self, redis: Redis, keys: Keys, heartbeat_ttl_s: float = 5.0) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_ms = int(heartbeat_ttl_s * 1000)
        self._snapshot = redis.register_script(_SNAPSHOT_LUA)
        self._underflow = redis.register_script(_UNDERFLOW_LUA)
        self._prune = redis.register_script(_PRUNE_LUA)
        self._release_many = redis.register_script(_RELEASE_MANY_LUA)
        self._remove = redis.register_script(_REMOVE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._unlock = redis.register_script(_UNLOCK_LUA)

    # ---- a replica's own entry -----------------------------------------------------------

    async def register(self, info: ReplicaInfo, lease: str = "1") -> None:
        """Write the whole entry, (re-)join the set and take a heartbeat lease: the heartbeat
        key holds ``lease`` (a token new to each registration) until its TTL lapses."""
        info.heartbeat_at = time.time()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.replica(info.replica_id), mapping=info.to_hash())
            pipe.sadd(self._keys.replicas, info.replica_id)
            pipe.set(self._keys.heartbeat(info.replica_id), lease, px=self._ttl_ms)
            await pipe.execute()

    async def renew(self, info: ReplicaInfo, lease: str) -> bool:
        """Refresh the entry and the lease, only while the heartbeat key still holds
        ``lease``; False when it lapsed (the replica must register again, with a new one)."""
        info.heartbeat_at = time.time()
        k, rid = self._keys, info.replica_id
        pairs = [x for pair in info.to_hash().items() for x in pair]
        keys = [k.heartbeat(rid), k.replica(rid), k.replicas]
        return bool(await self._renew(keys=keys, args=[lease, self._ttl_ms, rid, *pairs]))

    def lease_key(self, replica_id: str) -> str:
        """The key a replica's lease token lives in (what its answers are fenced by)."""
        return self._keys.heartbeat(replica_id)

    async def heartbeat(self, replica_id: str, **fields: object) -> None:
        """Refresh liveness and optionally update fields (state, weight_version, served)."""
        mapping: dict[FieldT, EncodableT] = {k: str(v) for k, v in fields.items()}
        mapping["heartbeat_at"] = str(time.time())
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._keys.replica(replica_id), mapping=mapping)
            pipe.set(self._keys.heartbeat(replica_id), "1", px=self._ttl_ms)
            await pipe.execute()

    async def deregister(self, replica_id: str) -> None:
        """A graceful exit; the replica's stream stays for the janitor to empty. A drain mark
        goes too: a replica started later under the same id serves again."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.srem(self._keys.replicas, replica_id)
            pipe.srem(self._keys.draining, replica_id)
            pipe.delete(self._keys.replica(replica_id), self._keys.heartbeat(replica_id))
            pipe.hdel(self._keys.inflight, replica_id)
            await pipe.execute()

    # ---- reads -----------------------------------------------------------------------------

    async def get(self, replica_id: str) -> ReplicaInfo | None:
        raw = await self._redis.hgetall(self._keys.replica(replica_id))
        if not raw:
            return None
        alive = bool(await self._redis.exists(self._keys.heartbeat(replica_id)))
        return ReplicaInfo.from_hash(replica_id, raw, alive)

    async def list(self) -> list[ReplicaInfo]:
        """Every registered replica with an entry, alive or not, sorted by id (every hash this
        class writes has ``heartbeat_at``; a member without one is half-removed)."""
        return [r for r in (await self.snapshot()).replicas if r.heartbeat_at]

    async def is_registered(self, replica_id: str) -> bool:
        return bool(await self._redis.sismember(self._keys.replicas, replica_id))

    async def snapshot(
        self, session_id: str | None = None, sessions: Sequence[str] = ()
    ) -> RegistrySnapshot:
        """Replicas, in-flight counts, draining set (and sessions' sticky replicas) at once."""
        keys = [self._keys.replicas, self._keys.inflight, self._keys.draining]
        asked = ([session_id] if session_id else []) + [s for s in sessions if s]
        keys += [self._keys.sticky(s) for s in asked]
        args = [self._keys.replica_prefix, HEARTBEAT_SUFFIX]
        ids, hashes, alive, inflight, draining, found = await self._snapshot(keys, args)
        stickies = {s: _s(r) for s, r in zip(asked, found, strict=True) if _s(r)}
        infos = [
            ReplicaInfo.from_hash(_s(rid), _pairs(raw), bool(up))
            for rid, raw, up in zip(ids, hashes, alive, strict=True)
        ]
        return RegistrySnapshot(
            replicas=sorted(infos, key=lambda r: r.replica_id),
            inflight={k: int(v) for k, v in _pairs(inflight).items()},
            draining={_s(d) for d in draining},
            sticky=stickies.get(session_id or ""),
            stickies=stickies,
        )

    async def streams_without_replica(self, registered: set[str]) -> set[str]:
        """Ids whose rollout stream exists but who are not registered (left, or forgotten
        by a router that restarted): their queued work still needs a home."""
        prefix = self._keys.rollout_stream_prefix
        found = set()
        async for name in self._redis.scan_iter(match=prefix + "*", count=1000):
            replica_id = _s(name)[len(prefix) :]
            if ":" not in replica_id and replica_id not in registered:
                found.add(replica_id)
        return found

    # ---- the routers' shared state ---------------------------------------------------------

    async def release(self, replica_id: str) -> None:
        """One request fewer in flight (never below zero): one command, and a second step
        only in the rare case it went below zero."""
        if await self._redis.hincrby(self._keys.inflight, replica_id, -1) < 0:
            await self._underflow(keys=[self._keys.inflight], args=[replica_id])

    async def claim_many(
        self, counts: Mapping[str, int], pins: Mapping[str, str], sticky_ttl_s: float
    ) -> None:
        """Count a whole batch in flight in one round trip: ``counts`` more requests
        per replica, each session of ``pins`` pinned to its replica."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for replica_id, count in counts.items():
                pipe.hincrby(self._keys.inflight, replica_id, count)
            for session_id, replica_id in pins.items():
                pipe.set(self._keys.sticky(session_id), replica_id, px=int(sticky_ttl_s * 1000))
            await pipe.execute()

    async def release_many(self, counts: Mapping[str, int]) -> None:
        """``release`` for a whole batch in one round trip (never below zero)."""
        args = [x for replica_id, n in counts.items() if n > 0 for x in (replica_id, n)]
        if args:
            await self._release_many(keys=[self._keys.inflight], args=args)

    async def prune_counts(self) -> None:
        """Drop in-flight counts of replicas that are not registered any more, judged by the
        membership at this instant (one step): a replica that registered and got its first
        request since the caller's snapshot keeps its count."""
        await self._prune(keys=[self._keys.inflight, self._keys.replicas])

    @property
    def inflight_key(self) -> str:
        """The hash of in-flight counts (``WorkQueue.recount`` writes the truth into it)."""
        return self._keys.inflight

    async def mark_draining(self, replica_id: str) -> None:
        await self._redis.sadd(self._keys.draining, replica_id)

    async def is_draining(self, replica_id: str) -> bool:
        return bool(await self._redis.sismember(self._keys.draining, replica_id))

    async def remove(self, replica_id: str) -> bool:
        """Delete everything left of a replica (entry, marks, counts, stream) unless it is
        alive again; True when it was removed."""
        k = self._keys
        keys = [
            k.heartbeat(replica_id),
            k.replicas,
            k.draining,
            k.inflight,
            k.replica(replica_id),
            k.rollout_stream(replica_id),
        ]
        return bool(await self._remove(keys=keys, args=[replica_id]))

    async def lock_janitor(self, token: str, ttl_ms: int) -> bool:
        """Take the lock that lets one router at a time move dead replicas' work."""
        return bool(await self._redis.set(self._keys.janitor_lock, token, nx=True, px=ttl_ms))

    async def unlock_janitor(self, token: str) -> None:
        await self._unlock(keys=[self._keys.janitor_lock], args=[token])

    async def live(self, min_version: int = 0) -> builtins.list[ReplicaInfo]:
        """Alive replicas that are serving at ``min_version`` or newer."""
        return [
            r
            for r in await self.list()
            if r.alive and r.state == ReplicaState.SERVING and r.weight_version >= min_version
        ]
