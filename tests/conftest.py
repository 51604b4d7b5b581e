"""Fixtures shared by unit and integration tests.

Redis: one real server per test session, started by us on a free loopback port (never the
machine's own server on 6379, never ``RLFLEET_REDIS_URL``). It starts in well under a second,
so tests use it rather than a fake. Each test gets a unique cluster name, and the scratch
database behind ``redis_url`` is flushed before every test.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from redis_servers import empty_database

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis

# Tests flush this database freely; longer-lived fixtures that keep data across tests use db 0.
SCRATCH_DB = 1


# ---- Redis --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A Redis-compatible server owned by this test session; stopped even if tests fail."""
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of an empty scratch database on the session's server."""
    return empty_database(redis_server, SCRATCH_DB)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client (bytes responses) on the scratch database."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def cluster_name() -> str:
    """A cluster name no other test uses, so key namespaces never overlap."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def keys(cluster_name: str) -> Keys:
    return Keys(cluster_name)
