"""Oversized prompts against a real router and a real replica process (hf, tiny model).

A 3 MB ``prompt_text`` once stalled a replica's event loop for seconds of tokenization, so it
lost its lease three times, dropped its other jobs, and the caller got UNAVAILABLE after 22 s.
Now: the router refuses it at once (INVALID_ARGUMENT naming the limit); a replica handed one
directly on its stream answers INVALID_ARGUMENT without tokenizing it; a prompt at the byte
limit is tokenized off the loop, refused for its token count, and all the while the replica
keeps its lease and answers its other jobs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import redis.asyncio as aioredis
from replica_proc import MODEL
from router_fleet import Fleet, add_replica, launch_fleet, teardown

from rlfleet.common.errors import ErrorCode
from rlfleet.common.grpc_client import make_channel
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.proto import rollout_pb2_grpc
from rlfleet.rollout.convert import request_to_proto
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
THREE_MB = "1+" * (3 * 1024 * 1024 // 2)


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = launch_fleet(redis_server, tmp_path_factory.mktemp("doors"))
    try:
        add_replica(fleet, "rd", "max_message_mb=8")
        yield fleet
    finally:
        teardown(fleet)


def request(prompt: str) -> GenerateRequest:
    return GenerateRequest(uuid.uuid4().hex, SamplingParams(max_tokens=4), prompt_text=prompt)


async def test_router_refuses_a_3mb_prompt_at_once(fleet: Fleet):
    channel = make_channel(fleet.address, retry=False)
    try:
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rollout_pb2_grpc.RolloutStub(channel).Generate(
                request_to_proto(request(THREE_MB)), timeout=30
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "3145728 bytes > rollout.max_prompt_bytes 1048576" in refused.value.details()
        assert time.monotonic() - began < 5
    finally:
        await channel.close()


async def test_replica_answers_oversized_jobs_and_keeps_its_lease(fleet: Fleet):
    redis = aioredis.Redis.from_url(fleet.redis_url)
    queue = WorkQueue(redis, fleet.keys, fleet.keys.rollout_stream("rd"), "rollout")
    lease = await redis.get(fleet.keys.heartbeat("rd"))
    try:
        big, at_limit = request(THREE_MB), request("1" * 1024 * 1024)
        small = [request(f"{i}+1=") for i in range(4)]
        began = time.monotonic()
        for r in [big, at_limit, *small]:
            await queue.submit(r.request_id, r.to_json())
        answers = await asyncio.gather(
            *(queue.wait_result(r.request_id, timeout_s=60) for r in [big, at_limit, *small])
        )
        elapsed = time.monotonic() - began
        refused_big, refused_long, *served = answers
        assert refused_big.code is ErrorCode.INVALID_ARGUMENT
        assert "3145728 bytes > rollout.max_prompt_bytes 1048576" in refused_big.message
        assert refused_long.code is ErrorCode.INVALID_ARGUMENT
        assert "> rollout.max_prompt_tokens 63" in refused_long.message
        assert all(a.ok for a in served)
        assert await redis.get(fleet.keys.heartbeat("rd")) == lease  # never lost it
        assert elapsed < 30
        assert await redis.xlen(fleet.keys.dead_letter(fleet.keys.rollout_stream("rd"))) == 0
    finally:
        await redis.aclose()
