"""Scale with real processes: two routers on one Redis, a client given both addresses that
goes on when one is SIGKILLed, admission control (RESOURCE_EXHAUSTED / HTTP 429 when every
replica's queue is full), ``DrainReplica`` and SIGTERM (work in hand finishes, the replica
deregisters and exits 0, promptly).

One fleet serves the module: routers A (with the OpenAI HTTP front) and B, two hf replicas whose
queued requests each take ``DELAY_S``, and a queue bound of ``LIMIT`` per replica. The tests
run in order and use it up: B is killed, then one replica drained, then the other SIGTERMed.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from replica_proc import MODEL, ReplicaProc, start_replica, stop_replica
from router_proc import RouterProc, start_http_router
from router_proc import start_router as start_grpc_router

from rlfleet.common.errors import ResourceExhausted
from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
DELAY_S = 1.0  # every queued request sleeps this long on its replica
LIMIT = 2  # router.max_queue_per_replica
ROUTER_ARGS = (f"router.max_queue_per_replica={LIMIT}", "router.route_wait_s=5")
REPLICA_ARGS = ("rollout.backend=hf", f"rollout.debug_generate_delay_s={DELAY_S}")


@dataclass
class Fleet:
    keys: Keys
    url: str
    routers: dict[str, RouterProc] = field(default_factory=dict)
    replicas: dict[str, ReplicaProc] = field(default_factory=dict)

    @property
    def both(self) -> str:
        return f"{self.routers['a'].address},{self.routers['b'].address}"


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    log_dir = tmp_path_factory.mktemp("scale")
    fleet = Fleet(Keys(f"t{uuid.uuid4().hex[:12]}"), redis_server.url)
    try:
        with ThreadPoolExecutor(4) as pool:  # everything loads at once
            replicas = [
                pool.submit(
                    start_replica, fleet.url, fleet.keys, rid, log_dir / f"{rid}.log", *REPLICA_ARGS
                )
                for rid in ("sa", "sb")
            ]
            routers = {
                name: pool.submit(
                    start_router, fleet, log_dir / f"router-{name}.log", http=name == "a"
                )
                for name in ("a", "b")
            }
        for future in replicas:  # a failed start stopped its own process; keep the others
            if future.exception() is None:
                fleet.replicas[future.result().replica_id] = future.result()
        fleet.routers = {n: f.result() for n, f in routers.items() if f.exception() is None}
        for future in [*replicas, *routers.values()]:
            future.result()
        yield fleet
    finally:
        for replica in fleet.replicas.values():
            stop_replica(replica, signal.SIGKILL)
        for router in fleet.routers.values():
            router.proc.stop(signal.SIGKILL)


def start_router(fleet: Fleet, log_path: Path, http: bool) -> RouterProc:
    """A router process; with ``http`` its OpenAI front too (that one loads a tokenizer)."""
    if http:
        return start_http_router(fleet.url, fleet.keys, log_path, *ROUTER_ARGS, ready_s=240)
    extra = (f"model.path={MODEL}", *ROUTER_ARGS)
    proc, address = start_grpc_router(fleet.url, fleet.keys, log_path, *extra, ready_s=240)
    return RouterProc(proc, address, "")


def request(tag: str = "", timeout_s: float = 60) -> GenerateRequest:
    return GenerateRequest(
        f"{tag}{uuid.uuid4().hex}",
        SamplingParams(n=1, max_tokens=4),
        prompt_text="12+34=",
        timeout_s=timeout_s,
    )


async def outcomes(client: RolloutClient, count: int) -> list[object]:
    """Results or exceptions of ``count`` concurrent Generate calls."""
    calls = [client.generate(request()) for _ in range(count)]
    return await asyncio.gather(*calls, return_exceptions=True)


async def test_two_routers_serve_one_fleet(fleet: Fleet) -> None:
    async with (
        RolloutClient(fleet.routers["a"].address) as a,
        RolloutClient(fleet.routers["b"].address) as b,
    ):
        same = request("shared-")
        first, second = await asyncio.gather(a.generate(same), b.generate(same))
        assert first.completions == second.completions  # one execution, one answer
        seen = [{r.replica_id for r in await c.list_replicas()} for c in (a, b)]
    assert seen == [{"sa", "sb"}, {"sa", "sb"}]


async def test_full_queues_answer_resource_exhausted_and_http_429(fleet: Fleet) -> None:
    async with RolloutClient(fleet.routers["a"].address) as client:
        burst = asyncio.gather(
            *(client.generate(request()) for _ in range(4 * LIMIT)), return_exceptions=True
        )
        await wait_full(client)
        async with httpx.AsyncClient(timeout=30) as http:
            body = {"model": "tiny-qwen2-arith", "prompt": "1+1=", "max_tokens": 2}
            reply = await http.post(f"{fleet.routers['a'].base_url}/completions", json=body)
        results = await burst
    assert reply.status_code == 429, reply.text
    assert "queue is full" in reply.json()["error"]["message"]
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    answered = [r for r in results if not isinstance(r, BaseException)]
    assert len(refused) + len(answered) == len(results), results
    assert refused and len(answered) >= LIMIT, results
    assert "max_queue_per_replica=2" in str(refused[0])


async def wait_full(client: RolloutClient, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(r.in_flight >= LIMIT for r in await client.list_replicas()):
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the replicas' queues never filled")


async def test_client_with_both_addresses_goes_on_when_a_router_is_killed(fleet: Fleet) -> None:
    async with RolloutClient(fleet.both) as client:
        assert all(not isinstance(r, BaseException) for r in await outcomes(client, 2))
        wave = asyncio.gather(*(client.generate(request()) for _ in range(2)))
        await wait_in_flight(client, 2)  # both calls queued: one came through each router
        fleet.routers["b"].proc.kill()
        assert len(await wave) == 2  # calls that were on B went on through A
        for _ in range(3):  # and new ones keep being answered
            assert all(not isinstance(r, BaseException) for r in await outcomes(client, 2))


async def wait_in_flight(client: RolloutClient, count: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sum(r.in_flight for r in await client.list_replicas()) >= count:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"never {count} requests in flight")


async def test_drained_replica_finishes_its_work_deregisters_and_exits_0(fleet: Fleet) -> None:
    victim = fleet.replicas["sb"]
    async with RolloutClient(fleet.routers["a"].address) as client:
        work = asyncio.gather(*(client.generate(request()) for _ in range(2 * LIMIT)))
        await wait_full(client)
        await client.drain_replica("sb")
        assert {r.replica_id for r in await work} == {"sa", "sb"}  # sb's share answered
        code = await asyncio.to_thread(victim.proc.wait, 30)
        assert code == 0
        assert [r.replica_id for r in await client.list_replicas()] == ["sa"]
        assert {r.replica_id for r in await outcomes(client, 2)} == {"sa"}
    assert "is drained and has no work left" in victim.log_tail()
    assert not redis.Redis.from_url(fleet.url).sismember(fleet.keys.draining, "sb")


async def test_sigterm_finishes_work_in_hand_then_exits_0_promptly(fleet: Fleet) -> None:
    victim = fleet.replicas["sa"]
    async with RolloutClient(fleet.routers["a"].address) as client:
        # the request must land on sa: sb is gone after the drain test; run alone (or on
        # another xdist worker than that test), this test drains sb itself
        if "sb" in {r.replica_id for r in await client.list_replicas()}:
            await client.drain_replica("sb")
            await asyncio.to_thread(fleet.replicas["sb"].proc.wait, 30)
        call = asyncio.ensure_future(client.generate(request()))
        await wait_until_running(victim)
        signalled = time.monotonic()
        victim.proc.popen.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(victim.proc.wait, 30)
        took = time.monotonic() - signalled
        assert (await call).replica_id == "sa"  # answered before the replica left
    assert code == 0
    assert took < DELAY_S + 2.0, f"exit took {took:.1f} s after SIGTERM"
    assert "deregistered" in victim.log_tail()


async def wait_until_running(replica: ReplicaProc, timeout_s: float = 10) -> None:
    """Until the replica has read a request from its stream (it then sleeps ``DELAY_S``)."""
    client = redis.Redis.from_url(replica.redis_url)
    stream = replica.keys.rollout_stream(replica.replica_id)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if client.exists(stream) and client.xpending(stream, "rollout")["pending"]:
                return
            await asyncio.sleep(0.02)
    finally:
        client.close()
    raise TimeoutError("the request never reached the replica")
