"""The one way every role opens its asyncio Redis client.

- No socket timeout: redis-py 8's default (5 s) wraps each write in ``asyncio.wait_for``,
  which on Python 3.11 can swallow task cancellation and hang a shutdown; keepalive and
  periodic health checks detect dead links instead.
- A blocking pool: a burst of concurrent calls waits for a free connection rather than
  failing with "Too many connections".
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis


def connect(url: str, max_connections: int = 256) -> Redis:
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max(4, max_connections),
        socket_timeout=None,
        socket_keepalive=True,
        health_check_interval=30,
    )
    return Redis.from_pool(pool)
