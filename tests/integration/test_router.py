"""Router and rollout replicas as real processes (hf backend, tiny model), called over gRPC.

What a trainer relies on: one session's requests land on one replica, sessions spread over
the fleet, a request whose replica is SIGKILLed mid-generation is still answered, a request no
replica can serve is refused clearly, and a bad request does not hurt the router.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from replica_proc import MODEL, stop_replica
from router_fleet import Fleet, add_replica, launch_fleet, teardown

from rlfleet.common.grpc_client import make_channel
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.proto import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout.convert import request_to_proto
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One router and two replicas, shared by the tests that do not break anything."""
    fleet = launch_fleet(redis_server, tmp_path_factory.mktemp("router_fleet"))
    try:
        add_replica(fleet, "ra")
        add_replica(fleet, "rb")
        yield fleet
    finally:
        teardown(fleet)


@pytest.fixture
async def stubs(fleet: Fleet):
    """Stubs on a channel without automatic retries, so status codes arrive as they are."""
    channel = make_channel(fleet.address, retry=False)
    yield rollout_pb2_grpc.RolloutStub(channel), rollout_pb2_grpc.RouterStub(channel)
    await channel.close()


def request(session: str = "", prompt: str = "12+34=", **fields) -> rollout_pb2.GenerateRequest:
    sampling = SamplingParams(n=2, max_tokens=4, temperature=1.0)
    plain = GenerateRequest(uuid.uuid4().hex, sampling, prompt_text=prompt, session_id=session)
    msg = request_to_proto(plain)
    for name, value in fields.items():
        setattr(msg, name, value)
    return msg


async def test_list_replicas_shows_both_serving(stubs):
    _, router = stubs
    listed = await router.ListReplicas(common_pb2.Empty())
    assert {(r.replica_id, r.state) for r in listed.replicas} == {
        ("ra", "serving"),
        ("rb", "serving"),
    }
    assert all(r.address and r.backend == "hf" and r.in_flight == 0 for r in listed.replicas)


async def test_one_session_sticks_and_sessions_spread(stubs):
    rollout, _ = stubs
    group = [await rollout.Generate(request("group-1")) for _ in range(6)]
    assert len({r.replica_id for r in group}) == 1
    assert all(len(r.completions) == 2 and r.completions[0].token_ids for r in group)
    spread = await asyncio.gather(*(rollout.Generate(request(f"g{i}")) for i in range(16)))
    assert {r.replica_id for r in spread} == {"ra", "rb"}


async def test_invalid_requests_are_refused_and_router_keeps_serving(stubs):
    rollout, _ = stubs
    for bad in (request(request_id=""), request(prompt="1" * 80)):  # 80 > max_model_len 64
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rollout.Generate(bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await rollout.Generate(request())).completions


async def test_version_above_every_replica_is_refused_quickly(stubs):
    rollout, _ = stubs
    began = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await rollout.Generate(request(min_weight_version=99))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "version >= 99 (newest is 0)" in refused.value.details()
    assert time.monotonic() - began < 10


async def test_control_rpcs_point_to_the_replicas(stubs):
    rollout, router = stubs
    for call in (rollout.GetStatus, rollout.Pause, rollout.FlushCache):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(common_pb2.Empty())
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "directly" in refused.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # scoring asks one replica
        await rollout.ScoreTokens(rollout_pb2.ScoreTokensRequest())
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await router.DrainReplica(rollout_pb2.DrainReplicaRequest(replica_id="nope"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.fixture
def slow_fleet(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Fleet]:
    """Its own cluster: two replicas that sleep 3 s inside every request."""
    fleet = launch_fleet(redis_server, tmp_path)
    try:
        for replica_id in ("slow-a", "slow-b"):
            add_replica(fleet, replica_id, "rollout.debug_generate_delay_s=3")
        yield fleet
    finally:
        teardown(fleet)


async def holder_of_pending_work(fleet: Fleet, timeout_s: float = 10) -> str:
    """The replica that has taken a request and not answered it yet."""
    client = aioredis.Redis.from_url(fleet.redis_url, socket_timeout=None)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for replica_id in fleet.replicas:
                stream = fleet.keys.rollout_stream(replica_id)
                if (
                    await client.exists(stream)
                    and (await client.xpending(stream, "rollout"))["pending"]
                ):
                    return replica_id
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()
    raise TimeoutError("no replica took the request")


async def test_request_survives_sigkill_of_its_replica(slow_fleet: Fleet):
    channel = make_channel(slow_fleet.address, retry=False)
    rollout, router = rollout_pb2_grpc.RolloutStub(channel), rollout_pb2_grpc.RouterStub(channel)
    try:
        began = time.monotonic()
        call = asyncio.ensure_future(rollout.Generate(request("doomed"), timeout=60))
        victim = await holder_of_pending_work(slow_fleet)
        stop_replica(slow_fleet.replicas[victim], signal.SIGKILL)  # mid-request (3 s delay)
        answer = await call
        assert answer.replica_id == ({"slow-a", "slow-b"} - {victim}).pop()
        assert answer.completions and time.monotonic() - began < 30
        for _ in range(100):  # the janitor forgets the dead replica once its stream is empty
            listed = await router.ListReplicas(common_pb2.Empty())
            if [r.replica_id for r in listed.replicas] == [answer.replica_id]:
                break
            await asyncio.sleep(0.1)
        assert [r.replica_id for r in listed.replicas] == [answer.replica_id]
    finally:
        await channel.close()
