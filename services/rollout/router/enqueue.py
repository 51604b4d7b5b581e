"""A routed Generate in one Redis round trip: bind the id, pick the replica, queue, count.

Why: step by step, a routed request cost about ten round trips before its answer came back
(result lookup, waiter count, registry snapshot, claim, bind and queue, ...), ~7 ms over a
direct replica call. Here the router takes the *candidates* (alive, serving, recent enough, not
drained) from a registry snapshot it keeps for a moment (``SnapshotCache``), and one Lua step
(``Enqueuer.enqueue``) does the rest against the live state:

- refuse an id bound to other content, hand back a stored answer, or join the execution that
  is already queued for the id (counted as one more waiter);
- otherwise pick among the candidates by the live in-flight counts and the session's pin (the
  rule of ``routing.pick_replica``: the pinned replica while under the cap, else the least
  loaded, ties broken by the caller's random number; a session without a usable pin goes to
  a replica under the cap with the fewest active pinned sessions, then the least loaded: that
  part is this step's own, ``pick_replica`` has no session counts), check that the pick is
  still serving at
  the version and not drained (and, with an admission limit, that some candidate's queue has
  room: else ``Placed.FULL``), then bind the id, queue the entry on the pick's stream, count it
  in flight and pin the session.

A stale cache therefore costs a retry (``Placed.STALE``: the caller refreshes its snapshot and
tries again), never a placement on a replica that is updating, paused or drained. Liveness is
the one thing read from the cache alone: a replica that died in the last instant gets the
request, and the janitor moves it, as it would for one that died just after being picked.

Why new sessions are placed by active session count: the requests of a GRPO group (or the
first turns of many conversations) arrive together, over several connections, in no set order.
Placed by in-flight requests alone, a group whose first request came early looks light while
the rest of it is still on the way, and the next new groups pile onto the other replica
(measured: 6 groups against 2). Each replica's pinned sessions live in a sorted set scored by
their last request; a session counts as active for ``ACTIVE_SESSION_WINDOW_MS`` after it, so
sessions that ended (one-shot calls, finished conversations) stop weighing on a replica, and
entries older than the sticky TTL are dropped.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from rlfleet.common.keys import Keys
from rlfleet.common.queue.entries import xadd_lua
from rlfleet.common.queue.results import Result, decode_result
from rlfleet.common.queue.scripts import BINDING_LUA, WAITERS_LUA
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaRegistry
from rlfleet.rollout.types import GenerateRequest

# KEYS: binding, result, sticky (the binding again without a session), waiters, inflight,
# draining. ARGV: request id, fingerprint, submission, result ttl, waiters ttl, payload, weight,
# stream prefix, replica-hash prefix, '1' with a session, cap, random in [0, 1), sticky ttl ms,
# min version, queue limit (0: none), pinned-set prefix, active-session window ms, then the
# candidates' ids. Returns {code} or {code, replica id or answer}. The binding, the waiter
# count and the entry are written as the work queue writes them (``BINDING_LUA``,
# ``WAITERS_LUA``, ``xadd_lua``).
_ENQUEUE_LUA = (
    BINDING_LUA
    + WAITERS_LUA
    + """local got = redis.call('MGET', KEYS[1], KEYS[2], KEYS[3])
local bound, stored, pin = got[1], got[2], got[3]
if bound_elsewhere(bound, ARGV[2]) then return {-1} end
if stored then return {0, stored} end
if bound then
  join(KEYS[4], ARGV[5])
  return {2}
end
local cands = {unpack(ARGV, 18)}
local loads = redis.call('HMGET', KEYS[5], unpack(cands))
local cap, limit, session = tonumber(ARGV[11]), tonumber(ARGV[15]), ARGV[10] == '1'
local target, open = nil, {}
for i, id in ipairs(cands) do
  local load = math.max(0, tonumber(loads[i]) or 0)
  if limit == 0 or load < limit then
    if session and id == pin and load < cap then target = id end
    open[#open + 1] = {id, load}
  end
end
if #open == 0 then return {4} end
local now = 0
if session then
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
if not target then
  local fewest, tied = nil, {}
  for _, c in ipairs(open) do
    local rank = c[2]
    if session then  -- under the cap first, then fewest active sessions, then least loaded
      redis.call('ZREMRANGEBYSCORE', ARGV[16] .. c[1], '-inf', now - tonumber(ARGV[13]))
      local active = redis.call('ZCOUNT', ARGV[16] .. c[1], now - tonumber(ARGV[17]), '+inf')
      local full = c[2] >= cap and 1 or 0
      rank = full * 1e15 + active * 1e6 + math.min(c[2], 999999)
    end
    if fewest == nil or rank < fewest then fewest, tied = rank, {c[1]}
    elseif rank == fewest then tied[#tied + 1] = c[1] end
  end
  target = tied[math.min(#tied, math.floor(tonumber(ARGV[12]) * #tied) + 1)]
end
local info = redis.call('HMGET', ARGV[9] .. target, 'state', 'weight_version')
if info[1] ~= 'serving' or (tonumber(info[2]) or -1) < tonumber(ARGV[14])
   or redis.call('SISMEMBER', KEYS[6], target) == 1 then return {3, target} end
bind(KEYS[1], ARGV[2], ARGV[3], ARGV[4])
"""
    + xadd_lua("ARGV[8] .. target", "ARGV[1]", "ARGV[6]", "'0'", "ARGV[7]", "ARGV[3]")
    + """
redis.call('HINCRBY', KEYS[5], target, ARGV[7])
if session then
  redis.call('SET', KEYS[3], target, 'PX', ARGV[13])
  if pin and pin ~= target then redis.call('ZREM', ARGV[16] .. pin, KEYS[3]) end
  redis.call('ZADD', ARGV[16] .. target, now, KEYS[3])
  redis.call('PEXPIRE', ARGV[16] .. target, ARGV[13])
end
return {1, target}"""
)


ACTIVE_SESSION_WINDOW_MS = 2000
"""How long after its last request a pinned session still counts against its replica when a
new session is placed (a step's requests arrive well within it)."""


class Placed(enum.IntEnum):
    """What ``Enqueuer.enqueue`` did with a request."""

    CONFLICT = -1  # the id is bound to other content
    ANSWERED = 0  # the id has an answer already (``Enqueued.stored``)
    QUEUED = 1  # queued now on ``Enqueued.replica_id``, counted in flight there
    JOINED = 2  # queued before (its first execution is alive): counted as one more waiter
    STALE = 3  # the pick is no longer serving, recent enough or undrained: refresh, retry
    FULL = 4  # every candidate's queue holds ``Placement.limit`` requests


@dataclass(frozen=True)
class Enqueued:
    outcome: Placed
    replica_id: str = ""
    stored: Result | None = None


@dataclass(frozen=True)
class Placement:
    """How to choose among the candidates (``router`` config), and this request's coin."""

    cap: int  # a pinned replica with this many in flight is not reused
    limit: int | None  # admission: a replica with this many in flight takes nothing new
    sticky_ttl_s: float
    coin: float  # in [0, 1): breaks ties between equally loaded candidates


class Enqueuer:
    """The router's one-step submit (see the module docstring)."""

    def __init__(self, redis: Redis, keys: Keys, result_ttl_s: int = 3600) -> None:
        self._keys, self._result_ttl_s = keys, result_ttl_s
        self._script = redis.register_script(_ENQUEUE_LUA)

    async def enqueue(
        self,
        request: GenerateRequest,
        fingerprint: str,
        submission: str,
        candidates: list[str],
        placement: Placement,
        waiters_ttl_s: int,
        pin: bool = True,
    ) -> Enqueued:
        """Bind, place among ``candidates`` (non-empty, sorted) and queue, in one step.
        ``pin=False`` (round robin) ignores the session: no pin is read or written."""
        k, rid = self._keys, request.request_id
        session = request.session_id if pin else ""
        keys = [
            k.request(rid),
            k.result(rid),
            k.sticky(session) if session else k.request(rid),
            k.waiters(rid),
            k.inflight,
            k.draining,
        ]
        args = [
            rid,
            fingerprint,
            submission,
            self._result_ttl_s,
            waiters_ttl_s,
            request.to_json(),
            1,
            k.rollout_stream_prefix,
            k.replica_prefix,
            "1" if session else "0",
            placement.cap,
            repr(placement.coin),
            max(1, int(placement.sticky_ttl_s * 1000)),
            request.min_weight_version,
            placement.limit or 0,
            k.pinned_prefix,
            ACTIVE_SESSION_WINDOW_MS,
            *candidates,
        ]
        reply = await self._script(keys=keys, args=args)
        outcome = Placed(int(reply[0]))
        if outcome is Placed.ANSWERED:
            return Enqueued(outcome, stored=decode_result(rid, reply[1]))
        return Enqueued(outcome, _text(reply[1]) if len(reply) > 1 else "")


class SnapshotCache:
    """The registry as read at most ``max_age_s`` ago; one refresh at a time, shared by every
    request that finds the copy too old (no stampede of snapshots)."""

    def __init__(self, registry: ReplicaRegistry, max_age_s: float) -> None:
        self._registry, self._max_age_s = registry, max_age_s
        self._snap: RegistrySnapshot | None = None
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    async def get(self, fresh: bool = False) -> RegistrySnapshot:
        """The cached snapshot; with ``fresh``, one read after this call began."""
        asked_at = time.monotonic()
        if not fresh and (snap := self._current()) is not None:
            return snap
        async with self._lock:
            recent = self._read_at >= asked_at if fresh else self._current() is not None
            if not recent or self._snap is None:
                self.put(await self._registry.snapshot())
            assert self._snap is not None
            return self._snap

    def put(self, snap: RegistrySnapshot) -> None:
        """Take a snapshot read just now (``list_replicas`` reads one anyway)."""
        self._snap, self._read_at = snap, time.monotonic()

    def invalidate(self) -> None:
        """Read afresh next time (a replica looked dead, drained or changed)."""
        self._read_at = float("-inf")

    def _current(self) -> RegistrySnapshot | None:
        return self._snap if time.monotonic() - self._read_at < self._max_age_s else None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
