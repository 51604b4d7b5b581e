"""Rollout replica under disruption: updates mid-request, a killed replica, pause/resume.

The replica runs with ``rollout.debug_generate_delay_s`` so queued requests stay in flight long
enough to interrupt (hf backend: the behaviour under test lives in the replica, not the engine).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from replica_proc import MODEL, ReplicaProc, start_replica, stop_replica
from safetensors.torch import load_file

from rlfleet.common.errors import Unavailable
from rlfleet.common.keys import Keys
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.model import weights
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, GenerateResult, SamplingParams

DELAY_S = 2.0
SLOW = (
    "rollout.backend=hf",
    f"rollout.debug_generate_delay_s={DELAY_S}",
    "rollout.drain_timeout_s=0.2",
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture
def launch(redis_server: EmbeddedRedis, tmp_path) -> Iterator:
    """Start replicas (same cluster for the whole test); every one is stopped at the end."""
    keys, started = Keys(f"t{uuid.uuid4().hex[:12]}"), []

    def start(replica_id: str = "slow") -> ReplicaProc:
        proc = start_replica(
            redis_server.url, keys, replica_id, tmp_path / f"{replica_id}.log", *SLOW
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop_replica(proc, signal.SIGKILL)


@pytest.fixture
async def redis_db0(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def queue_for(replica: ReplicaProc, client: aioredis.Redis) -> WorkQueue:
    return WorkQueue(
        client, replica.keys, replica.keys.rollout_stream(replica.replica_id), "rollout"
    )


async def submit(queue: WorkQueue, count: int, min_weight_version: int = 0) -> list[str]:
    ids = []
    for _ in range(count):
        request = GenerateRequest(
            f"q-{uuid.uuid4().hex}",
            SamplingParams(n=2, max_tokens=4),
            prompt_text="12+34=",
            min_weight_version=min_weight_version,
        )
        assert await queue.submit(request.request_id, request.to_json())
        ids.append(request.request_id)
    return ids


async def wait_in_flight(client: RolloutClient, count: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.status()).in_flight < count:
        assert time.monotonic() < deadline, "requests never went in flight"
        await asyncio.sleep(0.05)


async def new_address(client: aioredis.Redis, replica: ReplicaProc, old: str) -> str:
    """The address a restarted replica serves at, once serving (the registry may still show
    its old entry, then the new one as ``starting``)."""
    deadline = time.monotonic() + 60
    while True:
        address, state = await client.hmget(
            replica.keys.replica(replica.replica_id), ["address", "state"]
        )
        if address.decode() != old and state == b"serving":
            return address.decode()
        assert time.monotonic() < deadline, "the restarted replica never served"
        await asyncio.sleep(0.1)


async def answers(queue: WorkQueue, ids: list[str], timeout_s: float = 30) -> list[GenerateResult]:
    results = await asyncio.gather(*[queue.wait_result(i, timeout_s) for i in ids])
    assert all(r is not None and r.ok for r in results), results
    return [GenerateResult.from_json(r.payload) for r in results]


async def test_update_cancels_in_flight_requests_which_rerun_on_new_weights(
    launch, redis_db0
) -> None:
    replica = launch()
    queue = queue_for(replica, redis_db0)
    async with RolloutClient(replica.address) as client:
        ids = await submit(queue, 3)
        await wait_in_flight(client, 3)
        header, payload = weights.encode(load_file(str(MODEL / "model.safetensors")), 7)
        assert (await client.push_weights(header, payload)).version == 7
        results = await answers(queue, ids)
    # Every answer carries v7: the update did not wait the requests out (they would have
    # answered with v0), it cancelled them and they re-ran on the new weights; none was lost.
    assert {r.weight_version for r in results} == {7}
    assert await queue.length() == 0


async def test_restarted_replica_with_the_same_id_finishes_its_pending_work(
    launch, redis_db0
) -> None:
    first = launch("phoenix")
    queue = queue_for(first, redis_db0)
    async with RolloutClient(first.address) as client:
        ids = await submit(queue, 2)
        await wait_in_flight(client, 2)
    stop_replica(first, signal.SIGKILL)  # dies holding both entries, unacknowledged
    assert await queue.pending_count() == 2
    second = launch("phoenix")
    # launch() returns on a registry entry that says serving, which the killed replica's still
    # does until its TTL runs out: wait for the new process's own (under load its start took
    # longer than the answers' deadline).
    await new_address(redis_db0, second, first.address)
    results = await answers(queue, ids)
    assert {r.replica_id for r in results} == {second.replica_id}
    assert await queue.pending_count() == 0


async def test_restarted_replica_parks_work_that_needs_weights_it_lost_until_a_push(
    launch, redis_db0
) -> None:
    """Restarted under its id, the replica is back at v0; entries queued for the v3 it had
    wait for a push of v3 (no FAILED_PRECONDITION answer a retry would find stored)."""
    tensors = load_file(str(MODEL / "model.safetensors"))
    first = launch("phoenix-v3")
    queue = queue_for(first, redis_db0)
    async with RolloutClient(first.address) as client:
        assert (await client.push_weights(*weights.encode(tensors, 3))).version == 3
        ids = await submit(queue, 2, min_weight_version=3)
        await wait_in_flight(client, 2)
    stop_replica(first, signal.SIGKILL)
    second = launch("phoenix-v3")
    second.address = await new_address(redis_db0, second, first.address)
    async with RolloutClient(second.address) as client:
        assert (await client.status()).weight_version == 0
        assert await queue.wait_result(ids[0], timeout_s=DELAY_S + 1.0) is None  # parked
        assert await queue.pending_count() == 2
        assert (await client.push_weights(*weights.encode(tensors, 3))).version == 3
        results = await answers(queue, ids)
    assert {(r.replica_id, r.weight_version) for r in results} == {(second.replica_id, 3)}
    assert await queue.pending_count() == 0


async def test_pause_holds_the_queue_and_resume_releases_it(launch, redis_db0) -> None:
    replica = launch()
    queue = queue_for(replica, redis_db0)
    async with RolloutClient(replica.address) as client:
        assert (await client.pause()).state == "paused"
        ids = await submit(queue, 1)  # a read already blocking may take it, but not run it
        assert await queue.wait_result(ids[0], timeout_s=1.5) is None
        assert (await client.status()).in_flight == 0
        with pytest.raises(Unavailable):
            await client.generate(GenerateRequest("direct", SamplingParams(), prompt_text="1+2="))
        assert (await client.resume()).state == "serving"
        [result] = await answers(queue, ids)
    assert result.replica_id == replica.replica_id


@pytest.mark.vllm
async def test_replica_exits_when_its_vllm_engine_dies_and_leaves_work_queued(
    redis_server: EmbeddedRedis, tmp_path, redis_db0
) -> None:
    import psutil  # a vLLM dependency

    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    replica = start_replica(
        redis_server.url,
        keys,
        "mortal",
        tmp_path / "mortal.log",
        "rollout.backend=vllm",
        "rollout.debug_generate_delay_s=3",
    )
    try:
        queue = queue_for(replica, redis_db0)
        async with RolloutClient(replica.address) as client:
            ids = await submit(queue, 1)
            await wait_in_flight(client, 1)
        children = psutil.Process(replica.proc.pid).children()
        [engine] = [p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name()]
        engine.kill()  # a child of our own replica process
        assert await asyncio.to_thread(replica.proc.wait, 60) == 1
    finally:
        stop_replica(replica, signal.SIGKILL)
    assert await queue.get_result(ids[0]) is None  # not answered with an error...
    assert await queue.length() == 1  # ...but left for the router's janitor to move
    assert not await redis_db0.exists(keys.replica("mortal"))
