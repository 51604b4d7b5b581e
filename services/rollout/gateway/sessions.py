"""Gateway sessions in Redis: AReaL's ``start_session`` / ``set_reward`` / ``end_session``.

Why Redis and not the router's memory: several routers serve one cluster side by side (and a
router may restart), so a session started through one router is recorded and ended through
any other. Every step is one Lua script, so a call is never recorded into a session that
another router is ending at that moment. Keys (``P`` = ``rlfleet:<cluster>``; ids are minted
here as ``rls-<32 hex>`` so they never alias another key)::

    P:session:<id>         hash   state (open | ended), reward; TTL = the session's life
    P:session_calls:<id>   list   the recorded calls in order (CallRecord JSON); same TTL
    P:sessions             zset   open session id -> deadline (ms), for counting expiries
    P:sessions:stats       hash   started, ended, expired, segmented, calls (counters)

A session lives ``ttl_s`` after its last touch (start, a recorded call, set_reward). One that
never ends expires: ``sweep`` (run at each start and stats read) drops it and counts it
``expired``. An ended session keeps its hash (state ``ended``) for another ``ttl_s``, so a
late call is refused as ended (409), not as unknown (404). Ending is idempotent: for
``ENDED_ANSWER_S`` after the end its calls are kept and a second end answers the same episode
(counted once), so a client whose answer was lost on the way (a dropped connection) may ask
again; after that a second end is refused as ended (409).
"""

from __future__ import annotations

import json
import math
import re
import uuid

from redis.asyncio import Redis

from rlfleet.common import errors
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.config.agent import MultiCall
from rlfleet.common.keys import Keys
from rlfleet.rollout.gateway.trajectory import CallRecord, is_token_native, session_episode

SESSION_PREFIX = "rls-"
SESSION_ID = re.compile(r"^rls-[0-9a-f]{32}$")
MAX_CALLS = 1024
SWEEP_LIMIT = 256
ENDED_ANSWER_S = 120.0
OPEN, ENDED = "open", "ended"
_NOW_MS = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"
_START = (
    _NOW_MS
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'open')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[2])
redis.call('HINCRBY', KEYS[3], 'started', 1)
return 1
"""
)
_TOUCH = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'open' then return -2 end
"""
_RECORD = (
    _NOW_MS
    + _TOUCH
    + """
local n = redis.call('LLEN', KEYS[2])
local new = #ARGV - 3
if n + new > tonumber(ARGV[3]) then return -3 end
for i = 4, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), ARGV[2])
redis.call('HINCRBY', KEYS[4], 'calls', new)
return n + new
"""
)
_REWARD = (
    _NOW_MS
    + _TOUCH
    + """
redis.call('HSET', KEYS[1], 'reward', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), ARGV[2])
return 1
"""
)
_END = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {-1} end
if state ~= 'open' then
  local kept = redis.call('LRANGE', KEYS[2], 0, -1)
  if tonumber(redis.call('HGET', KEYS[1], 'ncalls') or -1) ~= #kept then return {-2} end
  local again = {2, redis.call('HGET', KEYS[1], 'reward') or ''}
  for _, call in ipairs(kept) do table.insert(again, call) end
  return again
end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'reward', ARGV[3]) end
local reward = redis.call('HGET', KEYS[1], 'reward') or ''
local calls = redis.call('LRANGE', KEYS[2], 0, -1)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], 'state', 'ended', 'ncalls', #calls)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
redis.call('HINCRBY', KEYS[4], 'ended', 1)
local answer = {1, reward}
for _, call in ipairs(calls) do table.insert(answer, call) end
return answer
"""
_SWEEP = (
    _NOW_MS
    + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
for _, id in ipairs(ids) do
  if redis.call('HGET', ARGV[1] .. id, 'state') ~= 'ended' then
    redis.call('HINCRBY', KEYS[2], 'expired', 1)
    redis.call('DEL', ARGV[1] .. id, ARGV[2] .. id)
  end
  redis.call('ZREM', KEYS[1], id)
end
return #ids
"""
)


class SessionError(errors.RlfleetError):
    """A refused session id; ``param`` is the request field that carried it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownSession(SessionError, errors.NotFound):
    """Never started here (another cluster's, made up) or expired: HTTP 404."""


class EndedSession(SessionError, errors.FailedPrecondition):
    """Ended already, or full: HTTP 409."""


class BadSessionField(SessionError, errors.InvalidArgument):
    """A value that is not what the field takes: HTTP 400."""


def is_session_id(value: str | None) -> bool:
    """Whether a call's session id names a gateway session (minted ids only; any other id is
    a plain sticky-routing id, as before the gateway)."""
    return value is not None and value.startswith(SESSION_PREFIX)


def check_session_id(value: object, param: str = "session_id") -> str:
    if not isinstance(value, str) or not SESSION_ID.match(value):
        raise BadSessionField(
            f"{param} must be a session id from /rl/start_session "
            f"(rls-<32 hex>), got {value!r:.80}",
            param,
        )
    return value


class SessionStore:
    """Sessions of one cluster; ``ttl_s`` is a session's life after its last touch."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: float, max_calls: int = MAX_CALLS):
        self._redis, self._prefix = redis, keys.prefix
        self.ttl_ms, self.max_calls = max(1, int(ttl_s * 1000)), max_calls
        self._scripts = {
            name: redis.register_script(source)
            for name, source in (
                ("start", _START),
                ("record", _RECORD),
                ("reward", _REWARD),
                ("end", _END),
                ("sweep", _SWEEP),
            )
        }

    @classmethod
    def for_config(cls, redis: Redis, config: RlfleetConfig) -> SessionStore:
        """The store of ``config``'s cluster, sessions living ``agent.gateway_session_ttl_s``."""
        return cls(redis, Keys(config.cluster), config.agent.gateway_session_ttl_s)

    def _keys(self, session_id: str) -> list[str]:
        return [
            f"{self._prefix}:session:{session_id}",
            f"{self._prefix}:session_calls:{session_id}",
            self._index,
            self._stats,
        ]

    @property
    def _index(self) -> str:
        return f"{self._prefix}:sessions"

    @property
    def _stats(self) -> str:
        return f"{self._prefix}:sessions:stats"

    async def start(self) -> str:
        """A new open session's id (expired ones are swept and counted first)."""
        await self.sweep()
        while True:
            session_id = SESSION_PREFIX + uuid.uuid4().hex
            keys = self._keys(session_id)
            if await self._scripts["start"](
                keys=[keys[0], keys[2], keys[3]], args=[self.ttl_ms, session_id]
            ):
                return session_id

    async def check_open(self, session_id: str, param: str) -> None:
        """Raise unless ``session_id`` is an open session (before spending a generation)."""
        state = await self._redis.hget(self._keys(session_id)[0], "state")
        self._refuse(session_id, param, -1 if state is None else 1 if _text(state) == OPEN else -2)

    async def record(self, session_id: str, calls: list[CallRecord], param: str) -> int:
        """Append the calls; the session's call count after them."""
        payloads = [json.dumps(call.to_dict(), separators=(",", ":")) for call in calls]
        code = await self._scripts["record"](
            keys=self._keys(session_id), args=[self.ttl_ms, session_id, self.max_calls, *payloads]
        )
        self._refuse(session_id, param, code)
        return int(code)

    async def set_reward(self, session_id: str, reward: float) -> None:
        check_session_id(session_id)
        code = await self._scripts["reward"](
            keys=self._keys(session_id)[:3], args=[self.ttl_ms, session_id, repr(reward)]
        )
        self._refuse(session_id, "session_id", code)

    async def end(
        self, session_id: str, reward: float | None = None, mode: MultiCall = "merge_prefixes"
    ) -> dict:
        """The session's episode (``trajectory.session_episode``, its calls as ``mode``
        branches); the session is ended. Asked again soon after, the same episode."""
        check_session_id(session_id)
        answer = await self._scripts["end"](
            keys=self._keys(session_id),
            args=[
                self.ttl_ms,
                session_id,
                "" if reward is None else repr(reward),
                int(ENDED_ANSWER_S * 1000),
            ],
        )
        self._refuse(session_id, "session_id", int(answer[0]))
        calls = [CallRecord.from_dict(json.loads(raw)) for raw in answer[2:]]
        if int(answer[0]) == 1 and not is_token_native(calls):
            await self._redis.hincrby(self._stats, "segmented", 1)
        stored = _text(answer[1])
        return session_episode(session_id, calls, float(stored) if stored else None, mode)

    async def sweep(self) -> int:
        """Drop the sessions past their deadline that never ended, counting them ``expired``."""
        return int(
            await self._scripts["sweep"](
                keys=[self._index, self._stats],
                args=[f"{self._prefix}:session:", f"{self._prefix}:session_calls:", SWEEP_LIMIT],
            )
        )

    async def stats(self) -> dict[str, int]:
        """The counters, and how many sessions are open now."""
        await self.sweep()
        raw = await self._redis.hgetall(self._stats)
        counts = {_text(k): int(v) for k, v in raw.items()}
        names = ("started", "ended", "expired", "segmented", "calls")
        return {
            **{name: counts.get(name, 0) for name in names},
            "open": int(await self._redis.zcard(self._index)),
        }

    def _refuse(self, session_id: str, param: str, code: int) -> None:
        if code == -1:
            raise UnknownSession(
                f"{param} {session_id!r} is not an open session of this "
                "gateway (never started here, or expired)",
                param,
            )
        if code == -2:
            raise EndedSession(f"{param} {session_id!r} has ended", param)
        if code == -3:
            raise EndedSession(
                f"{param} {session_id!r} holds {self.max_calls} calls, the most "
                "one session records",
                param,
            )


def check_reward(value: object, param: str = "reward") -> float:
    """A finite number (a bool is not a reward)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadSessionField(f"{param} must be a finite number, got {value!r:.80}", param)
    return float(value)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
