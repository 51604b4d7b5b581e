"""Redis restarted EMPTY under load (no AOF): every caller is still answered, once, quickly.

One fleet for the module (router, two hf replicas on the tiny model; real processes) on a
Redis this module starts without AOF, so a restart really loses everything: queued entries,
bindings, leases, answers, the registry. What must hold (issue 19, part 4):

- callers waiting on the router notice the loss (the request's binding is gone with its
  answer; a batch sees a new data epoch) and queue their requests again, so none of them
  waits for its deadline;
- replicas keep the answers they computed while the server was gone (their lease vanished
  with the data, the work did not move), instead of dropping them;
- a request that arrives while Redis is down waits for it, and for the replicas to register
  again, instead of failing UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
from replica_proc import MODEL, ReplicaProc
from router_fleet import Fleet, add_replica, teardown
from router_proc import start_router

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
DELAY_S = 1.0  # each queued request sleeps this long on its replica: in flight at the restart
TIMEOUT_S = 40.0  # the callers' deadline (before the fix, lost calls ran into it)
RECOVERY_S = 15.0  # every call answered within this of the restart (seconds on an idle box)


@dataclass
class RestartFleet:
    redis: EmbeddedRedis
    fleet: Fleet
    starter: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1))
    """Restarts Redis from one thread that lives as long as the module (the server dies with
    the thread that started it: ``PR_SET_PDEATHSIG``)."""

    async def crash(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.starter, self.redis.kill)

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.starter, self.redis.start)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartFleet]:
    log_dir = tmp_path_factory.mktemp("redis_restart")
    server = EmbeddedRedis(log_dir / "redis", appendonly=False)
    starter = ThreadPoolExecutor(1)
    starter.submit(server.start).result()
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    router, address = start_router(server.url, keys, log_dir / "router.log")
    fleet = Fleet(keys, server.url, router, address, log_dir)
    try:
        for replica_id in ("ra", "rb"):
            add_replica(fleet, replica_id, f"rollout.debug_generate_delay_s={DELAY_S}")
        yield RestartFleet(server, fleet, starter)
    finally:
        teardown(fleet)
        starter.submit(server.stop).result()
        starter.shutdown()


def request(tag: str, i: int) -> GenerateRequest:
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=4)
    return GenerateRequest(
        request_id=f"{tag}-{i}",
        session_id=f"{tag}-s{i % 8}",
        prompt_text="12+34=",
        sampling=sampling,
        timeout_s=TIMEOUT_S,
    )


async def one_call(client: RolloutClient, req: GenerateRequest) -> str:
    """How the call ended: "answered", or the error's type and text."""
    try:
        result = await client.generate(req)
    except Exception as exc:  # noqa: BLE001 - reported in the assertion
        return f"{type(exc).__name__}: {exc}"
    return "answered" if result.request_id == req.request_id else f"wrong id {result.request_id}"


def log_tails(fleet: Fleet) -> str:
    replicas: list[ReplicaProc] = list(fleet.replicas.values())
    return "\n".join([fleet.router.log_tail(15), *(r.log_tail(15) for r in replicas)])


async def test_calls_in_flight_across_an_empty_restart_are_all_answered(env: RestartFleet):
    async with RolloutClient(env.fleet.address) as client:
        calls = [asyncio.create_task(one_call(client, request("flight", i))) for i in range(40)]
        await asyncio.sleep(0.5)  # queued and running on the replicas (DELAY_S each)
        await env.crash()
        await asyncio.sleep(0.5)
        await env.start()  # empty: no AOF
        restarted = time.monotonic()
        outcomes = await asyncio.gather(*calls)
        took = time.monotonic() - restarted
    failed = [o for o in outcomes if o != "answered"]
    summary = f"{len(outcomes) - len(failed)}/40 answered, {took:.1f} s after the restart"
    print(summary)
    assert not failed, f"{summary}: {failed[:3]}\n{log_tails(env.fleet)}"
    assert took < RECOVERY_S, summary


async def test_a_batch_across_an_empty_restart_is_answered(env: RestartFleet):
    batch = [request("batch", i) for i in range(16)]
    async with RolloutClient(env.fleet.address) as client:
        call = asyncio.create_task(client.generate_batch(batch))
        await asyncio.sleep(0.5)
        await env.crash()
        await asyncio.sleep(0.5)
        await env.start()
        restarted = time.monotonic()
        results = await call
        took = time.monotonic() - restarted
    assert [r.request_id for r in results] == [r.request_id for r in batch]
    assert took < RECOVERY_S, f"batch answered {took:.1f} s after the restart"


async def test_a_request_sent_during_an_outage_waits_for_redis(env: RestartFleet):
    async with RolloutClient(env.fleet.address) as client:
        await one_call(client, request("warm", 0))  # the router's snapshot is warm
        await env.crash()
        calls = []
        for i in range(6):  # spread over the first half of a 3 s outage
            calls.append(asyncio.create_task(one_call(client, request("outage", i))))
            await asyncio.sleep(0.25)
        await asyncio.sleep(1.5)
        await env.start()  # empty, as after a crash without AOF
        outcomes = await asyncio.gather(*calls)
    failed = [o for o in outcomes if o != "answered"]
    assert not failed, f"{failed}\n{log_tails(env.fleet)}"
