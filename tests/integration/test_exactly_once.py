"""Exactly-once where it matters, with real processes: a router (janitor inside) and two hf
replicas over gRPC, broken with SIGKILL and SIGSTOP.

Each test counts what callers care about: requests answered, lost, and run twice. "Run twice"
is read from Redis and the replicas: ``entries-added`` of the replicas' streams (each request
queued on a live replica exactly once) and the replicas' ``served`` (answers they stored).
One fleet serves the whole module; the last test kills its router and starts another.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from procs import ServiceProcess
from replica_proc import MODEL, ReplicaProc, start_replica, stop_replica
from router_proc import start_router

from rlfleet.common.grpc_client import make_channel
from rlfleet.common.keys import Keys
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.proto import rollout_pb2_grpc
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.convert import request_to_proto
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
DELAY_S = 1.0  # every queued request sleeps this long on its replica before generating
SETTLE_S = 0.5  # after the expected answers are counted: time for a duplicate to show
TTL_S = 2.0  # heartbeat lease
REPLICA_ARGS = (
    "rollout.backend=hf",
    f"rollout.heartbeat_ttl_s={TTL_S}",
    f"rollout.debug_generate_delay_s={DELAY_S}",
)


@dataclass
class Fleet:
    keys: Keys
    url: str
    log_dir: Path
    router: ServiceProcess
    address: str
    replicas: dict[str, ReplicaProc] = field(default_factory=dict)
    routers: list[ServiceProcess] = field(default_factory=list)


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("exactly_once")
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    router, address = start_router(
        redis_server.url, keys, log_dir / "router1.log", "router.debug_move_delay_s=0.1"
    )
    fleet = Fleet(keys, redis_server.url, log_dir, router, address, routers=[router])
    try:
        with ThreadPoolExecutor(2) as pool:  # both load their model at once
            futures = [
                pool.submit(
                    start_replica, fleet.url, keys, rid, log_dir / f"{rid}.log", *REPLICA_ARGS
                )
                for rid in ("ea", "eb")
            ]
        for future in futures:  # a failed start stopped its own process; keep the others
            if future.exception() is None:
                fleet.replicas[future.result().replica_id] = future.result()
        for future in futures:
            future.result()
        yield fleet
    finally:
        for replica in fleet.replicas.values():
            with_signal(replica.proc.pid, signal.SIGCONT)
            stop_replica(replica, signal.SIGKILL)
        for process in fleet.routers:
            process.stop(signal.SIGKILL)


def with_signal(pid: int, sig: int) -> None:
    """Signal one of our own children, if it still runs."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
async def redis(fleet: Fleet):
    client = aioredis.Redis.from_url(fleet.url, socket_timeout=None)
    yield client
    await client.aclose()


def make_request(request_id: str, prompt: str = "12+34=", timeout_s: float = 60) -> GenerateRequest:
    return GenerateRequest(
        request_id, SamplingParams(n=1, max_tokens=4), prompt_text=prompt, timeout_s=timeout_s
    )


async def generate(address: str, request: GenerateRequest, timeout_s: float = 90):
    """The router's answer to one call (a fresh channel without retries: codes as they are)."""
    channel = make_channel(address, retry=False)
    try:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        return await stub.Generate(request_to_proto(request), timeout=timeout_s)
    finally:
        await channel.close()


async def served(fleet: Fleet) -> dict[str, int]:
    """Answers each replica has stored so far (its own count, not the registry's)."""
    counts = {}
    for replica_id, replica in fleet.replicas.items():
        async with RolloutClient(replica.address) as client:
            counts[replica_id] = (await client.status()).served
    return counts


async def served_once_more(fleet: Fleet, before: dict[str, int], count: int) -> dict[str, int]:
    """The counts once ``count`` answers more than ``before`` are stored. A replica counts an
    answer just after storing it, and the router may hand the answer back in between, so a
    caller can hear it before the count moves (under load, by more than a moment); once it has
    moved, wait a little longer so that a second execution, were there one, would show."""
    total = sum(before.values()) + count

    async def reached() -> bool:
        return sum((await served(fleet)).values()) >= total

    await until(reached, timeout_s=10, what=f"{count} more answers counted")
    await asyncio.sleep(SETTLE_S)
    return await served(fleet)


async def added(redis: aioredis.Redis, fleet: Fleet) -> int:
    """Entries ever queued on the live replicas' streams."""
    total = 0
    for replica_id in fleet.replicas:
        info = await redis.xinfo_stream(fleet.keys.rollout_stream(replica_id))
        total += int(info["entries-added"])
    return total


async def until(probe: Callable[[], object], timeout_s: float = 30, what: str = "") -> object:
    """``probe()``'s first truthy value (awaited if it is a coroutine), polled."""
    deadline = time.monotonic() + timeout_s
    while not (value := await _value(probe())):
        assert time.monotonic() < deadline, f"not reached in time: {what}"
        await asyncio.sleep(0.05)
    return value


async def _value(value: object) -> object:
    return await value if isinstance(value, Awaitable) else value


async def inflight(redis: aioredis.Redis, keys: Keys) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(keys.inflight)).items()}


async def test_one_id_sent_six_times_at_once_runs_once(fleet: Fleet, redis) -> None:
    before, queued = await served(fleet), await added(redis, fleet)
    request = make_request(f"dup-{uuid.uuid4().hex}")
    answers = await asyncio.gather(*(generate(fleet.address, request) for _ in range(6)))
    assert len({a.SerializeToString() for a in answers}) == 1  # all six got the one answer
    after = await served_once_more(fleet, before, 1)
    assert sum(after.values()) - sum(before.values()) == 1  # executed once
    assert await added(redis, fleet) - queued == 1
    other = make_request(request.request_id, prompt="99+1=")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(fleet.address, other)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in refused.value.details()


async def test_a_timed_out_call_is_aborted_and_its_retry_runs(fleet: Fleet, redis) -> None:
    before = await served(fleet)
    request = make_request(f"late-{uuid.uuid4().hex}", timeout_s=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await generate(fleet.address, request)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    logs = lambda: [r.proc.log() for r in fleet.replicas.values()]  # noqa: E731
    await until(
        lambda: any(f"request {request.request_id} aborted" in log for log in logs()),
        what="abort logged",
    )
    await asyncio.sleep(DELAY_S)  # an execution that was not aborted would answer by now
    assert await served(fleet) == before
    assert await redis.get(fleet.keys.result(request.request_id)) is None
    request.timeout_s = 60  # the caller retries under the same id: queued afresh, answered
    answer = await generate(fleet.address, request)
    assert answer.completions
    after = await served_once_more(fleet, before, 1)
    assert sum(after.values()) == sum(before.values()) + 1


async def test_a_stalled_replica_is_fenced_and_rejoins(fleet: Fleet, redis) -> None:
    """SIGSTOP a replica holding work past its lease: the work moves and is answered once;
    after SIGCONT its late answers are discarded and it registers again."""
    before = await served(fleet)
    victim = fleet.replicas["ea"]
    stream = fleet.keys.rollout_stream("ea")
    ids = [f"stall-{i}-{uuid.uuid4().hex}" for i in range(8)]
    calls = [asyncio.ensure_future(generate(fleet.address, make_request(rid))) for rid in ids]
    await until(lambda: held(redis, stream), what="the victim holds work")
    with_signal(victim.proc.pid, signal.SIGSTOP)
    try:
        answers = await asyncio.gather(*calls)
    finally:
        with_signal(victim.proc.pid, signal.SIGCONT)
    assert len(answers) == len(ids)
    registry = ReplicaRegistry(redis, fleet.keys, TTL_S)
    await until(lambda: rejoined(registry, "ea"), what="the victim registers again")
    await asyncio.sleep(DELAY_S + 0.5)  # time for any late answer of the victim
    assert "lost its lease" in victim.proc.log()
    after = await served_once_more(fleet, before, len(ids))
    assert sum(after.values()) - sum(before.values()) == len(ids)  # none answered twice
    assert {a.replica_id for a in answers} <= {"ea", "eb"} and all(a.completions for a in answers)
    await until(lambda: all_zero(redis, fleet.keys), what="in-flight counts back to 0")


async def held(redis: aioredis.Redis, stream: str) -> bool:
    return await redis.exists(stream) and (await redis.xpending(stream, "rollout"))["pending"] > 0


async def rejoined(registry: ReplicaRegistry, replica_id: str) -> bool:
    info = await registry.get(replica_id)
    return bool(info and info.alive and info.state == "serving")


async def all_zero(redis: aioredis.Redis, keys: Keys) -> bool:
    return not any((await inflight(redis, keys)).values())


async def test_router_killed_mid_migration_and_with_calls_in_flight(fleet: Fleet, redis) -> None:
    """A dead replica's 30 queued requests (one unreadable) are being moved, 40 calls are in
    flight, and the router is SIGKILLed. A second router finishes the move; the callers retry
    their ids there; in-flight counts come back to 0. Nothing is lost or run twice."""
    keys, queued, before = fleet.keys, await added(redis, fleet), await served(fleet)
    ghost = WorkQueue(redis, keys, keys.rollout_stream("ghost"), "rollout")
    await ghost.ensure_group()
    backlog = [make_request(f"ghost-{i}-{uuid.uuid4().hex}") for i in range(29)]
    for request in backlog:
        await ghost.submit(request.request_id, request.to_json())
    await ghost.submit(f"unreadable-{uuid.uuid4().hex}", b"not json")
    await ReplicaRegistry(redis, keys, 0.05).register(ReplicaInfo("ghost", "nowhere:1"))
    calls = [make_request(f"call-{i}-{uuid.uuid4().hex}") for i in range(40)]
    pending = [asyncio.ensure_future(generate(fleet.address, r)) for r in calls]
    await until(lambda: counted(redis, keys, 40), what="40 calls in flight")
    await until(lambda: midway(redis, ghost), what="migration under way")
    fleet.router.stop(signal.SIGKILL)
    left_at_kill = await ghost.length()
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, grpc.aio.AioRpcError) or r.completions for r in results)
    assert 0 < left_at_kill < 30 and await inflight(redis, keys)  # killed mid-way, counts stuck

    router, fleet.address = start_router(fleet.url, keys, fleet.log_dir / "router2.log")
    fleet.routers.append(router)
    retried = await asyncio.gather(*(generate(fleet.address, r) for r in calls))
    assert all(r.completions for r in retried)  # the same ids: answered, none lost
    answers = await asyncio.gather(*(ghost.wait_result(r.request_id, 60) for r in backlog))
    assert all(a is not None and a.ok for a in answers)
    [bad] = [r async for r in unreadable(ghost)]
    assert bad.code.name == "INVALID_ARGUMENT"  # dead-lettered with an answer, not dropped
    await until(lambda: all_zero(redis, keys), what="in-flight counts back to 0")
    assert await added(redis, fleet) - queued == 40 + 29  # each queued on a live replica once
    after = await served_once_more(fleet, before, 40 + 29)
    assert sum(after.values()) - sum(before.values()) == 40 + 29  # each answered once


async def counted(redis: aioredis.Redis, keys: Keys, total: int) -> bool:
    return sum((await inflight(redis, keys)).values()) >= total


async def midway(redis: aioredis.Redis, ghost: WorkQueue) -> bool:
    return 5 <= await ghost.length() <= 25


async def unreadable(ghost: WorkQueue):
    dead = await ghost._redis.xrange(ghost.dead_stream)
    for _, fields in dead:
        yield await ghost.get_result(fields[b"id"].decode())
