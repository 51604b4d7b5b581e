"""What a routed Generate costs in Redis, pinned so that a regression fails.

A Generate through the router used to cost ~38 Redis commands in about ten round trips (+6.8 ms
p50 over a direct replica call, ``bench/bench_router.py``). Now the router makes three round
trips (one Lua step that binds, places, queues and counts; one BLPOP whose wake-up carries the
answer; one HINCRBY to release) and the replica two (XREADGROUP; one Lua step that answers).

Counted on a server of this module's own as ``INFO commandstats`` deltas, which include the
commands run inside Lua scripts (they cost the server as much). Nothing runs in the background:
the router's janitor is not started, and the replica side is driven here with the same
``WorkQueue`` read and fenced finish the replica runs, registered once with a long lease. The
router's registry cache is refreshed every ``SNAPSHOT_MAX_AGE_S``; refreshes are counted apart
(each reads the replica set twice: ``SMEMBERS``), so the pin does not depend on the machine's
speed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rlfleet.common.config import load_config
from rlfleet.common.errors import ResourceExhausted
from rlfleet.common.keys import Keys
from rlfleet.common.queue.workqueue import Finish, WorkQueue, encode_result
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router.core import SNAPSHOT_MAX_AGE_S, RouterCore
from rlfleet.rollout.types import Completion, GenerateRequest, GenerateResult, SamplingParams

MAX_COMMANDS_PER_GENERATE = 22
"""Router and replica together, for a request with a session, registry refreshes apart
(measured: 22, by command: EVALSHA 2, SET 3, HINCRBY 2, HMGET 2, MGET 2, then
SISMEMBER, XADD, BLPOP, XREADGROUP, XDEL, RPUSH, EXPIRE, XACK, and TIME, ZADD, PEXPIRE
keeping the session in its replica's pinned set; it was ~38 before the one-step enqueue). All
inside the same Lua steps: the round trips stay at MAX_ROUTER_ROUND_TRIPS."""
MAX_ROUTER_ROUND_TRIPS = 3
REFRESH_COMMANDS = 6  # EVALSHA, SMEMBERS x2, HGETALL x2, EXISTS (one replica)
REQUESTS = 20


class CountingConnection(aioredis.Connection):
    """A real connection that counts what it sends: one send is one round trip."""

    sent = 0

    async def send_packed_command(self, command, check_health=True):  # noqa: ANN001
        CountingConnection.sent += 1
        return await super().send_packed_command(command, check_health)


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A server nobody else talks to, so its command counts are ours alone."""
    with EmbeddedRedis(Path(tmp_path_factory.mktemp("commands"))) as server:
        yield server


class Fleet:
    """A router core (janitor off, connections counted) and one replica driven by hand."""

    def __init__(self, url: str, keys: Keys, overrides: list[str]) -> None:
        pool = aioredis.ConnectionPool.from_url(
            url, connection_class=CountingConnection, socket_timeout=None
        )
        self.router_redis = aioredis.Redis.from_pool(pool)
        self.replica_redis = aioredis.Redis.from_url(url, socket_timeout=None)
        self.admin = aioredis.Redis.from_url(url)
        config = load_config(overrides=[f"cluster={keys.cluster}", *overrides], env={})
        self.core = RouterCore(self.router_redis, keys, config)
        self.keys = keys
        self.queue = WorkQueue(self.replica_redis, keys, keys.rollout_stream("r0"), "rollout")

    async def start(self) -> Fleet:
        registry = ReplicaRegistry(self.replica_redis, self.keys, heartbeat_ttl_s=600)
        await self.queue.ensure_group()
        await registry.register(ReplicaInfo("r0", "127.0.0.1:1", 0, "serving", "none"), "L")
        self.queue.fence = (registry.lease_key("r0"), "L")  # answers fenced, as a replica's are
        return self

    async def serve_one(self) -> None:
        """The replica's per-request path: read the entry, answer it through the fence."""
        [job] = await self.queue.read("r0", count=1, block_ms=10_000)
        request = GenerateRequest.from_json(job.payload)
        done = Completion([3], [-0.1], "3", "stop")
        answer = GenerateResult(request.request_id, [done], 0, "r0").to_json()
        assert await self.queue.finish(job, encode_result(answer)) is Finish.STORED

    async def generate(self, request_id: str, session: str = "s") -> GenerateResult:
        request = GenerateRequest(
            request_id, SamplingParams(max_tokens=1), prompt_text="1+2=", session_id=session
        )
        answer, _ = await asyncio.gather(self.core.generate(request), self.serve_one())
        return answer

    async def commands(self) -> Counter:
        stats = await self.admin.info("commandstats")
        return Counter({k[8:]: v["calls"] for k, v in stats.items() if k != "cmdstat_info"})

    async def close(self) -> None:
        for client in (self.router_redis, self.replica_redis, self.admin):
            await client.aclose()


@pytest.fixture
async def fleet(own_server: EmbeddedRedis, keys: Keys) -> AsyncIterator[Fleet]:
    started = await Fleet(own_server.url, keys, []).start()
    yield started
    await started.close()


async def test_a_routed_generate_costs_at_most_the_pinned_commands(fleet: Fleet) -> None:
    for index in range(3):  # scripts loaded, connections open, registry cached
        await fleet.generate(f"warm-{index}")
    before, sent, began = await fleet.commands(), CountingConnection.sent, time.monotonic()
    for index in range(REQUESTS):
        assert (await fleet.generate(f"req-{index}")).replica_id == "r0"
    elapsed, trips = time.monotonic() - began, CountingConnection.sent - sent
    delta = await fleet.commands() - before
    refreshes = delta["smembers"] // 2
    assert refreshes <= 2 + elapsed / SNAPSHOT_MAX_AGE_S, (refreshes, elapsed)  # cached
    per_request = (sum(delta.values()) - refreshes * REFRESH_COMMANDS) / REQUESTS
    assert per_request <= MAX_COMMANDS_PER_GENERATE, (per_request, sorted(delta.items()))
    assert (trips - refreshes) / REQUESTS <= MAX_ROUTER_ROUND_TRIPS, (trips, refreshes)
    for _ in range(100):  # released just after each answer went back
        if await fleet.admin.hget(fleet.keys.inflight, "r0") in (None, b"0"):
            break
        await asyncio.sleep(0.02)
    assert await fleet.admin.hget(fleet.keys.inflight, "r0") in (None, b"0")


async def test_the_live_queue_bound_refuses_even_when_the_cached_registry_looks_empty(
    own_server: EmbeddedRedis, keys: Keys
) -> None:
    """Admission is checked live in the enqueue step, not on the router's cached copy."""
    fleet = await Fleet(own_server.url, keys, ["router.max_queue_per_replica=2"]).start()
    try:
        await fleet.generate("cached")  # the registry is cached with r0 holding nothing
        await fleet.admin.hset(fleet.keys.inflight, "r0", 2)  # another router filled it
        request = GenerateRequest("refused", SamplingParams(max_tokens=1), prompt_text="1+2=")
        with pytest.raises(ResourceExhausted, match="max_queue_per_replica=2"):
            await fleet.core.generate(request)
        assert await fleet.queue.length() == 0  # nothing was queued
    finally:
        await fleet.close()
