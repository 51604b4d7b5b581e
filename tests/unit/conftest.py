"""Unit tests need no servers (docs/architecture.md, "Tests"): no Redis and no role process,
only in-process doubles. Kept by machine, not memory: here the shared Redis fixtures fail the
test that asks for one, and so does starting an embedded Redis any other way. A test that
needs Redis belongs in tests/integration/.
"""

from __future__ import annotations

import pytest

from rlfleet.common.redis_server import EmbeddedRedis

NO_SERVERS = "unit tests need no servers: a test that needs Redis belongs in tests/integration/"


@pytest.fixture(scope="session")
def redis_server():
    pytest.fail(NO_SERVERS)


@pytest.fixture(scope="module")
def redis_kind_server():
    pytest.fail(NO_SERVERS)


@pytest.fixture(autouse=True)
def _no_embedded_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: EmbeddedRedis) -> EmbeddedRedis:
        pytest.fail(NO_SERVERS)

    monkeypatch.setattr(EmbeddedRedis, "start", refuse)
