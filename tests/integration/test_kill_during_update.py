"""A replica or the router SIGKILLed while a weight update holds requests paused (``keep``).

Under ``rollout.update_policy: keep`` an update stops admission (state ``updating``), stops the
requests on the engine where they are, swaps the weights and continues them. The other keep
tests (``test_update_keep``, ``test_resume_in_flight``) let the update finish, or kill the
trainer; these kill the fleet's other parts inside that window, with real processes (a router
and one hf replica, ``router_fleet``), and count what the callers get.

How the kill lands inside the update, on a fast machine or a loaded one: the replica decodes
with the engine's debug delay (``rollout.debug_step_delay_s``, ``STEP_DELAY_S`` at every step),
so six calls that would run their whole budget under the old weights (a copy of the tiny
model whose end-of-sequence token it never samples, ``test_update_keep.long_model``) are still
generating, seconds later, when a push is sent; and since the delay also runs on the step that
sees the update's stop, the update holds them for at least ``STEP_DELAY_S``. A thread polling
the replica's registry entry signals the victim the moment it reads ``updating`` (the replica
writes it after it stopped admission, before it stops the requests, and only writes another
state after the requests were let go on), well inside that window. Nothing is left to chance,
so nothing is skipped: each test asserts that the kill did land there, the router test by the
answers' tokens (sampled by both versions, so stopped and continued) and the callers' retries,
the replica test by the registry entry it left behind (still ``updating``, and the push never
answered).

Counted: every call answered once, by the replica, with one finished sample (``length``, or
``stop``: the pushed weights may sample the end token) within its budget, each token stamped; the
answers stored across the replica's lives (its ``served`` count, the answers already in Redis
when it died) equal the calls; each request
queued once on the stream (``entries-added``), nothing left pending, nothing dead-lettered.
"""

# ruff: noqa: F811 - `long_model` is a fixture imported from test_update_keep
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
import redis.asyncio as aioredis
from replica_proc import MODEL, start_replica, stop_replica
from router_fleet import REPLICA_ARGS, Fleet, add_replica, launch_fleet, teardown
from router_proc import start_router
from test_update_keep import MAX_TOKENS, long_model, perturbed  # noqa: F401 - a fixture

from rlfleet.common.grpc_client import make_channel
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.model import weights
from rlfleet.proto import rollout_pb2_grpc
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.convert import request_to_proto
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
CALLS = 6
STEP_DELAY_S = 0.1  # 48 steps: ~5 s of decoding per call; the update holds them >= 0.1 s
DEADLINE_S = 300.0  # long enough for a replica restart (a model load) on a loaded machine
REPLICA = "kp"


@pytest.fixture(scope="module")
def fleet(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory, long_model: Path
) -> Iterator[Fleet]:
    fleet = launch_fleet(redis_server, tmp_path_factory.mktemp("kill_update"))
    try:
        add_replica(fleet, REPLICA, *keep_args(long_model))
        yield fleet
    finally:
        teardown(fleet)


def keep_args(model: Path) -> tuple[str, ...]:
    return (
        "rollout.update_policy=keep",
        f"model.path={model}",
        "rollout.hf_batch_wait_ms=1",
        f"rollout.debug_step_delay_s={STEP_DELAY_S}",
    )


def request(tag: str) -> GenerateRequest:
    return GenerateRequest(
        f"{tag}-{uuid.uuid4().hex[:8]}",
        SamplingParams(n=1, temperature=1.0, max_tokens=MAX_TOKENS),
        prompt_text="12+34=",
        timeout_s=DEADLINE_S,
    )


async def call(fleet: Fleet, req: GenerateRequest):
    """The router's answer; a call whose router died (UNAVAILABLE) is sent again, same id, to
    the fleet's router of the moment, as the fleet's contract lets a client do. Returns
    (answer, tries)."""
    tries = 0
    while True:
        tries += 1
        channel = make_channel(fleet.address, retry=False)
        try:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            return await stub.Generate(request_to_proto(req), timeout=DEADLINE_S + 30), tries
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or tries > 240:
                raise
            await asyncio.sleep(0.5)
        finally:
            await channel.close()


class Trigger:
    """Signals ``pid`` the moment the replica's registry entry reads ``updating`` (a thread
    polling Redis, so the test's event loop is not in the way)."""

    def __init__(self, fleet: Fleet, pid: int, sig: int) -> None:
        self._key, self._pid, self._sig = fleet.keys.replica(REPLICA), pid, sig
        self._client = redis.Redis.from_url(fleet.redis_url)
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Trigger:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self._client.close()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._client.hget(self._key, "state") == b"updating":
                os.kill(self._pid, self._sig)
                self.fired.set()
                return
            time.sleep(0.0002)


async def stream_counts(client: aioredis.Redis, fleet: Fleet) -> tuple[int, int, int]:
    """(entries ever added, entries pending, entries dead-lettered) of the replica's stream."""
    stream = fleet.keys.rollout_stream(REPLICA)
    added = int((await client.xinfo_stream(stream))["entries-added"])
    pending = (await client.xpending(stream, "rollout"))["pending"]
    return added, pending, await client.xlen(fleet.keys.dead_letter(stream))


async def until_generating(
    client: aioredis.Redis, fleet: Fleet, before: int, reqs: list[GenerateRequest]
) -> None:
    """Until every call is queued and held by the replica (and none answered: the step delay
    keeps each decoding for seconds)."""
    deadline = time.monotonic() + 120
    while True:
        added, pending, _ = await stream_counts(client, fleet)
        if added - before == CALLS and pending == CALLS:
            break
        assert time.monotonic() < deadline, (added, pending)
        await asyncio.sleep(0.01)
    assert await stored(client, fleet, reqs) == 0, "answered before the update could hold them"


async def push_next(address: str, model: Path) -> int:
    """Push perturbed weights, one version above the replica's; their version, if answered."""
    async with RolloutClient(address) as client:
        version = (await client.status()).weight_version + 1
        header, payload = weights.encode(perturbed(model), version)
        return (await client.push_weights(header, payload)).version


async def added_so_far(client: aioredis.Redis, fleet: Fleet) -> int:
    stream = fleet.keys.rollout_stream(REPLICA)
    if not await client.exists(stream):
        return 0
    return int((await client.xinfo_stream(stream))["entries-added"])


async def stored(client: aioredis.Redis, fleet: Fleet, reqs: list[GenerateRequest]) -> int:
    """How many of ``reqs`` have an answer in Redis now."""
    return sum([await client.exists(fleet.keys.result(r.request_id)) for r in reqs])


def check_answers(answers, reqs: list[GenerateRequest]) -> None:
    assert [a.request_id for a in answers] == [r.request_id for r in reqs]
    for answer in answers:
        assert answer.replica_id == REPLICA
        [completion] = answer.completions  # one sample: continued, never sampled twice
        assert completion.finish_reason in ("length", "stop"), completion
        assert 0 < len(completion.token_ids) <= MAX_TOKENS, completion
        assert len(completion.weight_versions) == len(completion.token_ids), completion


async def test_the_router_killed_while_an_update_holds_requests(
    fleet: Fleet,
    long_model: Path,
) -> None:
    """SIGKILL the router while the update holds the six requests; start another. The callers
    (UNAVAILABLE) retry the same ids there: each gets the one answer, every request ran once
    on the replica, across the update (tokens of both versions)."""
    client = aioredis.Redis.from_url(fleet.redis_url)
    replica = fleet.replicas[REPLICA]
    try:
        async with RolloutClient(replica.address) as status:
            served_before = (await status.status()).served
        before = await added_so_far(client, fleet)
        reqs = [request("router") for _ in range(CALLS)]
        calls = [asyncio.ensure_future(call(fleet, r)) for r in reqs]
        await until_generating(client, fleet, before, reqs)
        with Trigger(fleet, fleet.router.pid, signal.SIGKILL) as trigger:
            version = await push_next(replica.address, long_model)
            assert trigger.fired.is_set(), "the update ended before the router was killed"
        fleet.router.wait(30)
        fleet.router, fleet.address = start_router(
            fleet.redis_url, fleet.keys, fleet.log_dir / "router2.log"
        )
        results = await asyncio.gather(*calls)
        await asyncio.sleep(1.0)  # any late store lands before we count
        async with RolloutClient(replica.address) as status:
            served_after = (await status.status()).served
        added, pending, dead = await stream_counts(client, fleet)
    finally:
        await client.aclose()
    answers = [a for a, _ in results]
    check_answers(answers, reqs)
    assert any(tries > 1 for _, tries in results), "every answer came before the router died"
    assert served_after - served_before == CALLS  # none run twice, none lost
    assert (added - before, pending, dead) == (CALLS, 0, 0)
    crossed = [set(a.completions[0].weight_versions) for a in answers]
    assert any(v == {version - 1, version} for v in crossed), crossed  # paused, then continued


async def test_the_replica_killed_while_an_update_holds_requests(
    fleet: Fleet,
    long_model: Path,
) -> None:
    """SIGKILL the only replica while the update holds the six requests (its registry entry,
    left behind, still reads ``updating``); restart it under its id. Each call gets one answer
    of its whole budget; the successor stores exactly the answers the dead one had not; nothing
    is left pending or dead-lettered."""
    client = aioredis.Redis.from_url(fleet.redis_url)
    victim = fleet.replicas[REPLICA]
    try:
        before = await added_so_far(client, fleet)
        reqs = [request("replica") for _ in range(CALLS)]
        calls = [asyncio.ensure_future(call(fleet, r)) for r in reqs]
        await until_generating(client, fleet, before, reqs)
        with Trigger(fleet, victim.proc.pid, signal.SIGKILL) as trigger:
            pushed = asyncio.ensure_future(push_next(victim.address, long_model))
            await asyncio.wait([pushed], timeout=60)
        assert trigger.fired.is_set(), "the update ended before the replica was killed"
        victim.proc.wait(30)
        assert pushed.done() and pushed.exception() is not None  # the update never ended
        entry = await client.hgetall(fleet.keys.replica(REPLICA))
        assert entry[b"state"] == b"updating", entry  # it died inside the update
        answered_by_dead = await stored(client, fleet, reqs)
        stop_replica(victim, signal.SIGKILL)  # reaps what the kill left in its group
        successor = start_replica(
            fleet.redis_url,
            fleet.keys,
            REPLICA,
            victim.log_path,
            *REPLICA_ARGS,
            *keep_args(long_model),
        )
        fleet.replicas[REPLICA] = successor
        answers = [a for a, _ in await asyncio.gather(*calls)]
        await asyncio.sleep(1.0)  # any late store lands before we count
        async with RolloutClient(successor.address) as status:
            served_by_successor = (await status.status()).served
        added, pending, dead = await stream_counts(client, fleet)
    finally:
        await client.aclose()
    check_answers(answers, reqs)
    assert served_by_successor == CALLS - answered_by_dead  # none run twice, none lost
    assert (pending, dead) == (0, 0)
    # Not checked: how often each was queued. The dead replica's stream can be made anew
    # (its entries-added counter restarts), so the counter says nothing here; the served count
    # above is what proves that nothing ran twice.
