"""SIGSTOP a fleet's only replica past its lease, with callers waiting on deadlines.

Why a test of its own: the other SIGSTOP tests (``test_exactly_once``, ``chaos.py``) have a
second replica to move the stalled one's work to. With one replica there is nowhere to move
it: the janitor must leave it in the stalled replica's stream, the router must answer new
calls with a clear status (or queue them once the replica is back) rather than hold them past
their deadlines, and the replica, once continued, must find its lease gone, register again,
re-read its own stream and answer what it held, once.

Real processes: a router and one hf replica on the tiny model (``router_fleet``), on the
session's Redis. Counted per call: answered (with a completion, by our replica), or refused
with a clear status (``UNAVAILABLE``: no live replica to route it to) before its deadline;
answers stored by the replica (its ``served``
counter) equal the calls answered: none answered twice, none lost; and no request ran twice
on the replica (its log discards no answer as "moved away": nothing can move from the only
replica). ``DEADLINE_EXCEEDED`` is
not accepted: the stop is a fifth of a deadline, so a call that was queued and still ran out
its deadline was lost while the replica served again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from replica_proc import MODEL
from router_fleet import Fleet, add_replica, launch_fleet, teardown

from rlfleet.common.grpc_client import make_channel
from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.proto import rollout_pb2_grpc
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.convert import request_to_proto
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
TTL_S = 2.0  # router_fleet.REPLICA_ARGS: rollout.heartbeat_ttl_s=2
DELAY_S = 1.0  # every queued request sleeps this long on the replica: it holds work when stopped
STOP_S = 3 * TTL_S  # the lease lapses and the janitor has swept several times meanwhile
DEADLINE_S = 30.0  # each call's timeout_s
CLEAR = {grpc.StatusCode.UNAVAILABLE}  # refused at routing while no replica is alive


@dataclass
class Outcome:
    request_id: str
    replica_id: str = ""  # who answered; "" when the call failed
    code: grpc.StatusCode | None = None  # the failure's status
    ended_after_s: float = 0.0  # from the call's start


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = launch_fleet(redis_server, tmp_path_factory.mktemp("single_sigstop"))
    try:
        add_replica(fleet, "solo", f"rollout.debug_generate_delay_s={DELAY_S}")
        yield fleet
    finally:
        for replica in fleet.replicas.values():
            _signal(replica.proc.pid, signal.SIGCONT)
        teardown(fleet)


def _signal(pid: int, sig: int) -> None:
    """Signal our own child, if it still runs."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def call(address: str, tag: str) -> Outcome:
    """One Generate through the router, on a channel without retries (codes as they are)."""
    request = GenerateRequest(
        f"{tag}-{uuid.uuid4().hex[:8]}",
        SamplingParams(n=1, max_tokens=4),
        prompt_text="12+34=",
        timeout_s=DEADLINE_S,
    )
    started, channel = time.monotonic(), make_channel(address, retry=False)
    outcome = Outcome(request.request_id)
    try:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        answer = await stub.Generate(request_to_proto(request), timeout=DEADLINE_S + 30)
        assert answer.completions and answer.completions[0].token_ids, answer
        outcome.replica_id = answer.replica_id
    except grpc.aio.AioRpcError as exc:
        outcome.code = exc.code()
    finally:
        outcome.ended_after_s = time.monotonic() - started
        await channel.close()
    return outcome


async def served(fleet: Fleet) -> int:
    async with RolloutClient(fleet.replicas["solo"].address) as client:
        return (await client.status()).served


async def lease_token(redis, keys: Keys) -> bytes | None:
    return await redis.get(keys.heartbeat("solo"))


async def pending(redis, keys: Keys) -> int:
    stream = keys.rollout_stream("solo")
    return (await redis.xpending(stream, "rollout"))["pending"] if await redis.exists(stream) else 0


async def until(probe, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := await probe()):
        assert time.monotonic() < deadline, f"not reached in {timeout_s:g} s: {what}"
        await asyncio.sleep(0.05)
    return value


async def test_the_only_replica_stopped_past_its_lease(fleet: Fleet) -> None:
    """8 calls held by the replica when it is stopped, 4 more sent while it is stopped (its
    lease lapses: nowhere to route them), SIGCONT, then 4 after it is back. Every call is
    answered by it or refused UNAVAILABLE before its deadline; the held ones are
    all answered; the replica holds a new lease and serves; answers stored = calls answered."""
    import redis.asyncio as aioredis

    redis = aioredis.Redis.from_url(fleet.redis_url)
    victim = fleet.replicas["solo"]
    try:
        before, first_token = await served(fleet), await lease_token(redis, fleet.keys)
        held = [asyncio.ensure_future(call(fleet.address, "held")) for _ in range(8)]
        await until(lambda: pending(redis, fleet.keys), 30, "the replica holds work")
        _signal(victim.proc.pid, signal.SIGSTOP)
        stopped_at, during = time.monotonic(), []
        try:
            while time.monotonic() - stopped_at < STOP_S:  # one call per second while stopped
                during.append(asyncio.ensure_future(call(fleet.address, "during")))
                await asyncio.sleep(1.0)
            assert await lease_token(redis, fleet.keys) is None  # it lapsed while stopped
        finally:
            _signal(victim.proc.pid, signal.SIGCONT)
        new_token = await until(lambda: lease_token(redis, fleet.keys), 30, "a new lease")
        after = [await call(fleet.address, "after") for _ in range(4)]
        outcomes = [*await asyncio.gather(*held), *await asyncio.gather(*during), *after]
        await asyncio.sleep(DELAY_S + 0.5)  # any late store lands before we count
        stored = await served(fleet) - before
    finally:
        await redis.aclose()

    report = [(o.request_id, o.replica_id, o.code, round(o.ended_after_s, 1)) for o in outcomes]
    answered = [o for o in outcomes if o.replica_id]
    assert all(o.replica_id == "solo" or o.code in CLEAR for o in outcomes), report
    assert all(o.replica_id or o.ended_after_s < DEADLINE_S for o in outcomes), report
    assert all(o.replica_id for o in outcomes[:8]), report  # what it held is answered, here
    assert all(o.replica_id for o in outcomes[-4:]), report  # it serves again after SIGCONT
    assert stored == len(answered), (stored, report)  # none answered twice, none lost
    assert new_token != first_token
    assert "lost its lease" in victim.proc.log()
    # Nothing can move away from the only replica: an answer discarded as moved away is a
    # second run of one request here (a read in flight across the lapse, then the replay).
    assert "it was moved away" not in victim.proc.log()
    assert victim.proc.poll() is None
