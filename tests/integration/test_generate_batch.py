"""GenerateBatch: one training step's prompts in one call, one queue entry per replica.

What a trainer relies on: answers come back in request order, each with its ``n`` completions
and the engine's per-token log-probs; a session's requests land on one replica, in one batch
and across batches; a retried batch is answered from the stored answers; a bad member fails
the call with INVALID_ARGUMENT and an entry that fails as a whole fails every member; the
router's Redis round trips per batch do not grow with its size; each replica runs its share
as ONE engine batch; and a replica SIGKILLed while holding a packed entry costs nothing but
time (the janitor moves the entry, in-flight counts end at zero).

The router and replicas are real processes (hf backend, tiny model) except where a test needs
to look inside: the round-trip count (an in-process ``RouterCore`` on the same cluster, its
own Redis connections counted) and the engine batch count (an in-process ``Replica``).
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from replica_proc import MODEL, stop_replica
from router_fleet import Fleet, launch_fleet, teardown

from rlfleet.common.config import load_config
from rlfleet.common.errors import ErrorCode, InvalidArgument, Unavailable
from rlfleet.common.keys import Keys
from rlfleet.common.queue.workqueue import Failure, WorkQueue
from rlfleet.common.redis_client import connect
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router.batch import WAKE_POLL_S
from rlfleet.rollout.router.core import RouterCore
from rlfleet.rollout.types import GenerateRequest, SamplingParams, unpack_requests

needs_model = pytest.mark.skipif(
    not (MODEL / "model.safetensors").exists(), reason="tiny model not built"
)
PROMPTS = [f"{10 + 3 * i}+{5 + 7 * i % 50}=" for i in range(32)]


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One router and two replicas, shared by the tests that break nothing."""
    fleet = launch_fleet(redis_server, tmp_path_factory.mktemp("batch"), ["ga", "gb"])
    yield fleet
    teardown(fleet)


@pytest.fixture
async def client(fleet: Fleet) -> AsyncIterator[RolloutClient]:
    async with RolloutClient(fleet.address) as client:
        yield client


def batch(prompts: list[str], sessions: list[str] | None = None, n: int = 4, tokens: int = 8):
    sampling = SamplingParams(n=n, max_tokens=tokens, temperature=1.0)
    sessions = sessions or [f"s-{uuid.uuid4().hex[:8]}" for _ in prompts]
    return [
        GenerateRequest(f"q-{uuid.uuid4().hex}", sampling, prompt_text=p, session_id=s)
        for p, s in zip(prompts, sessions, strict=True)
    ]


# ---- the real router and replicas ------------------------------------------------------------


@pytest.mark.slow
@needs_model
async def test_answers_in_order_with_n_completions_and_logprobs(client: RolloutClient):
    requests = batch(PROMPTS[:8], n=4)
    results = await client.generate_batch(requests)
    assert [r.request_id for r in results] == [r.request_id for r in requests]
    for result in results:
        assert len(result.completions) == 4 and result.prompt_token_ids
        for c in result.completions:
            assert len(c.logprobs) == len(c.token_ids) >= 1
            assert all(lp <= 0 for lp in c.logprobs)
    assert {r.replica_id for r in results} == {"ga", "gb"}  # 8 sessions spread over both


@pytest.mark.slow
@needs_model
async def test_sessions_stick_within_and_across_batches(client: RolloutClient):
    sessions = [f"grp-{i}-{uuid.uuid4().hex[:6]}" for i in range(3) for _ in range(4)]
    first = await client.generate_batch(batch(PROMPTS[:12], sessions, n=2, tokens=4))
    second = await client.generate_batch(batch(PROMPTS[12:24], sessions, n=2, tokens=4))
    where: dict[str, set[str]] = {}
    for session, result in zip(sessions * 2, first + second, strict=True):
        where.setdefault(session, set()).add(result.replica_id)
    assert all(len(replicas) == 1 for replicas in where.values()), where


@pytest.mark.slow
@needs_model
async def test_retried_batch_is_answered_from_stored_answers(client: RolloutClient):
    requests = batch(PROMPTS[:4], n=3, tokens=6)
    first = await client.generate_batch(requests)
    again = await client.generate_batch(requests)
    single = await client.generate(requests[2])  # the plain RPC reads the packed answer too
    assert again == first and single == first[2]


@pytest.mark.slow
@needs_model
async def test_bad_member_fails_the_batch_and_the_router_keeps_serving(client: RolloutClient):
    too_long = batch(["1+1=", "1" * 80])  # 80 tokens > max_model_len 64: only a replica knows
    with pytest.raises(InvalidArgument, match=too_long[1].request_id):
        await client.generate_batch(too_long)
    twice = batch(["1+2="]) * 2
    with pytest.raises(InvalidArgument, match="more than once"):
        await client.generate_batch(twice)
    assert len(await client.generate_batch(batch(PROMPTS[:2]))) == 2


# ---- inside views: round trips, engine batches, a failed entry --------------------------------


class CountingConnection(aioredis.Connection):
    """A real connection that counts what it sends: one send is one round trip (a pipeline
    sends all its commands at once)."""

    sent = 0

    async def send_packed_command(self, command, check_health=True):  # noqa: ANN001
        CountingConnection.sent += 1
        return await super().send_packed_command(command, check_health)


@pytest.fixture
async def counted_core(fleet: Fleet) -> AsyncIterator[RouterCore]:
    """A second router on the fleet's cluster, in-process, janitor off, connections counted."""
    pool = aioredis.ConnectionPool.from_url(fleet.redis_url, connection_class=CountingConnection)
    redis = aioredis.Redis.from_pool(pool)
    config = load_config(overrides=[f"cluster={fleet.keys.cluster}"], env={})
    yield RouterCore(redis, fleet.keys, config)
    await redis.aclose()


async def round_trips(core: RouterCore, requests: list[GenerateRequest]) -> tuple[int, float]:
    before, began = CountingConnection.sent, time.monotonic()
    results = await core.generate_batch(requests)
    assert len(results) == len(requests)
    return CountingConnection.sent - before, time.monotonic() - began


@pytest.mark.slow
@needs_model
async def test_round_trips_per_batch_do_not_grow_with_its_size(counted_core: RouterCore):
    await round_trips(counted_core, batch(PROMPTS[:4], n=2, tokens=4))  # open connections
    small, small_s = await round_trips(counted_core, batch(PROMPTS[:4], n=2, tokens=4))
    large, large_s = await round_trips(counted_core, batch(PROMPTS[:32], n=2, tokens=4))
    # lookup, snapshot, claim, 2 submits, MGET+BLPOP per wake-up, entries, members, release
    for count, seconds in ((small, small_s), (large, large_s)):
        wakeups = 2 + math.ceil(seconds / WAKE_POLL_S)  # one per replica, one per poll
        assert count <= 6 + 2 + 2 * wakeups, (count, seconds)
    assert large <= small + 2 * math.ceil(large_s / WAKE_POLL_S), (small, large)


@pytest.fixture
async def own_cluster(redis_server: EmbeddedRedis) -> AsyncIterator[tuple[aioredis.Redis, Keys]]:
    redis = connect(redis_server.url)
    yield redis, Keys(f"t{uuid.uuid4().hex[:12]}")
    await redis.aclose()


@pytest.mark.slow
@needs_model
async def test_a_replicas_share_runs_as_one_engine_batch(own_cluster, tmp_path: Path):
    from rlfleet.rollout.engines.hf import HFEngine
    from rlfleet.rollout.replica import Replica

    redis, keys = own_cluster
    overrides = [
        f"cluster={keys.cluster}",
        f"model.path={MODEL}",
        "rollout.backend=hf",
        f"run_dir={tmp_path}",
    ]
    config = load_config(overrides=overrides, env={})
    replica = Replica(config, HFEngine(config), redis, keys, "solo", "in-process:0")
    await replica.start()
    core = RouterCore(redis, keys, config)
    try:
        before = replica.engine.batches
        results = await core.generate_batch(batch(PROMPTS[:8], n=4, tokens=6))
        assert replica.engine.batches - before == 1
        assert all(len(r.completions) == 4 and r.replica_id == "solo" for r in results)
    finally:
        await replica.shutdown(grace_s=1)
        await replica.engine.close()


async def test_an_entry_failing_as_a_whole_fails_every_member(own_cluster):
    redis, keys = own_cluster
    await ReplicaRegistry(redis, keys, 30).register(ReplicaInfo("fake", "x:0", 0, "serving"))
    queue = WorkQueue(redis, keys, keys.rollout_stream("fake"), "rollout")
    await queue.ensure_group()
    core = RouterCore(redis, keys, load_config(overrides=[], env={}))
    for code, raised in (
        (ErrorCode.INVALID_ARGUMENT, InvalidArgument),
        (ErrorCode.INTERNAL, Unavailable),
    ):
        requests = batch(["1+2=", "3+4=", "5+6="], n=1)
        call = asyncio.ensure_future(core.generate_batch(requests))
        jobs = []
        while not jobs and not call.done():
            jobs = await queue.read("fake", count=1, block_ms=100)
        assert len(unpack_requests(jobs[0].payload)) == 3  # one entry holds the whole share
        await queue.complete(jobs[0], b"", Failure(code, "the entry was unreadable"))
        with pytest.raises(raised, match="the entry was unreadable") as failed:
            await call
        assert requests[0].request_id in str(failed.value)  # the first member, in order
    snap = await core.registry.snapshot()
    assert snap.inflight.get("fake", 0) == 0


# ---- a replica dies holding a packed entry -----------------------------------------------------


@pytest.fixture
def slow_fleet(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Fleet]:
    """Two replicas that sleep 3 s inside every entry before generating."""
    fleet = launch_fleet(
        redis_server, tmp_path, ["slow-a", "slow-b"], "rollout.debug_generate_delay_s=3"
    )
    yield fleet
    teardown(fleet)


async def holder_of_pending_work(fleet: Fleet, timeout_s: float = 15) -> str:
    redis = aioredis.Redis.from_url(fleet.redis_url, socket_timeout=None)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for replica_id in fleet.replicas:
                stream = fleet.keys.rollout_stream(replica_id)
                if (
                    await redis.exists(stream)
                    and (await redis.xpending(stream, "rollout"))["pending"]
                ):
                    return replica_id
            await asyncio.sleep(0.05)
    finally:
        await redis.aclose()
    raise TimeoutError("no replica took the entry")


@pytest.mark.slow
@needs_model
async def test_batch_survives_sigkill_of_the_replica_holding_it(slow_fleet: Fleet):
    async with RolloutClient(slow_fleet.address) as client:
        requests = batch(PROMPTS[:4], ["one-group"] * 4, n=2, tokens=4)  # one packed entry
        call = asyncio.ensure_future(client.generate_batch(requests, timeout_s=90))
        victim = await holder_of_pending_work(slow_fleet)
        stop_replica(slow_fleet.replicas[victim], signal.SIGKILL)
        results = await call
        survivor = ({"slow-a", "slow-b"} - {victim}).pop()
        assert [r.request_id for r in results] == [r.request_id for r in requests]
        assert {r.replica_id for r in results} == {survivor}
        assert all(len(r.completions) == 2 for r in results)
        deadline = time.monotonic() + 30  # the moved entry's claim was released where it ran
        while time.monotonic() < deadline:
            listed = {s.replica_id: s.in_flight for s in await client.list_replicas()}
            if listed == {survivor: 0}:
                break
            await asyncio.sleep(0.1)
        assert listed == {survivor: 0}
