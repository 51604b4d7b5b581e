"""Which consumers of a stream wait for work right now, as the workers themselves say.

Why not ``XINFO CONSUMERS``: its ``idle`` means different things on different servers. On
Redis 7.0 a consumer that block-reads and gets nothing is never "seen" (a fresh one is not
even listed), so every worker looked busy and batches were never split; Valkey and Redis 7.2+
count the attempt. Here each worker writes its own state: a sorted set (``Keys.waiting``)
member per consumer, scored with the server's clock (``TIME``, so hosts' clocks may differ)
when it starts waiting, removed when it takes jobs. A dead worker's mark just ages out.
"""

from __future__ import annotations

from redis.asyncio import Redis

KEEP_MS = 60_000  # marks older than this are pruned, and the set expires this long after use

# KEYS[1] the board; ARGV[1] consumer. Marks the consumer waiting as of the server's clock.
MARK_LUA = """local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], t[1] * 1000 + math.floor(t[2] / 1000), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS[1] the board; ARGV[1] fresh_ms, ARGV[2] keep_ms. Consumers marked within fresh_ms.
COUNT_LUA = """local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - ARGV[2]))
return redis.call('ZCOUNT', KEYS[1], now - ARGV[1], '+inf')
"""


class WaitingBoard:
    """One stream's board of waiting consumers."""

    def __init__(self, redis: Redis, key: str) -> None:
        self._redis, self.key = redis, key
        self._mark = redis.register_script(MARK_LUA)
        self._count = redis.register_script(COUNT_LUA)

    async def waiting(self, consumer: str) -> None:
        await self._mark(keys=[self.key], args=[consumer, KEEP_MS])

    async def busy(self, consumer: str) -> None:
        await self._redis.zrem(self.key, consumer)

    async def count(self, fresh_ms: int) -> int:
        return int(await self._count(keys=[self.key], args=[fresh_ms, KEEP_MS]))
