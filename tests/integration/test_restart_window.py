"""A batch answered just before an empty Redis restart, its caller not yet having read it.

The window: every entry of a ``GenerateBatch`` has been answered and the router's wait has
seen that, but the members' own answers are read in a second step; if the server loses its
data between the two (an empty restart without AOF; here a ``FLUSHDB`` at that instant),
the members' answers are gone. Before, the call then failed UNAVAILABLE ("its answer was not
stored"), which the gRPC client retries: the batch ran again with nothing said about why.
Now the router sees the new data epoch, logs the loss and queues those members again within
the same call, so the caller gets every answer once. A stand-in replica (a consumer on the
replica's stream, answering as ``JobRunner`` does) counts what it ran.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import redis.asyncio as aioredis

from rlfleet.common.config import load_config
from rlfleet.common.keys import Keys
from rlfleet.common.queue.results import encode_result
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router import batch_path
from rlfleet.rollout.router.core import RouterCore
from rlfleet.rollout.types import (
    Completion,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    unpack_requests,
)


async def stand_in(
    redis: aioredis.Redis, keys: Keys, ran: Counter[str], stop: asyncio.Event
) -> None:
    """A replica "r" that registers (again, after the loss) and answers packed entries."""
    registry = ReplicaRegistry(redis, keys, 30)
    queue = WorkQueue(redis, keys, keys.rollout_stream("r"), "rollout")
    while not stop.is_set():
        if await registry.get("r") is None:
            await registry.register(ReplicaInfo("r", "x:0", 0, "serving"))
            await queue.ensure_group()
        for job in await queue.read("r", count=4, block_ms=100):
            members = unpack_requests(job.payload) or []
            answers = {}
            for request in members:
                ran[request.request_id] += 1
                result = GenerateResult(
                    request.request_id,
                    [Completion([5], [-1.0], "x", "length")],
                    0,
                    "r",
                    request.prompt_token_ids or [],
                )
                answers[request.request_id] = encode_result(result.encode())
            await queue.finish(job, encode_result(b""), answers)


async def test_members_answered_just_before_a_restart_are_queued_again(
    redis_url: str, monkeypatch, caplog
):
    redis = aioredis.Redis.from_url(redis_url)
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    ran: Counter[str] = Counter()
    stop = asyncio.Event()
    worker = asyncio.create_task(stand_in(redis, keys, ran, stop))
    waited = batch_path.wait_entries
    restarts = []

    async def then_restart(*args, **kwargs):
        done = await waited(*args, **kwargs)
        if not restarts:  # the entries are answered; the members' answers not read yet
            restarts.append(await redis.flushdb())
        return done

    monkeypatch.setattr(batch_path, "wait_entries", then_restart)
    core = RouterCore(redis, keys, load_config(overrides=["router.request_timeout_s=20"], env={}))
    batch = [
        GenerateRequest(
            f"w-{i}-{uuid.uuid4().hex[:6]}", SamplingParams(max_tokens=1), prompt_token_ids=[i + 1]
        )
        for i in range(3)
    ]
    try:
        results = await asyncio.wait_for(core.generate_batch(batch), 20)
    finally:
        stop.set()  # a flag: redis-py may swallow a cancellation (Python 3.11)
        await asyncio.wait_for(worker, 5)
        await core.close()
        await redis.aclose()
    assert restarts, "the batch never reached the window"
    assert [r.request_id for r in results] == [r.request_id for r in batch]
    assert all(ran[r.request_id] == 2 for r in batch), ran  # the first answers were lost
    assert "Redis lost a batch of 3" in caplog.text  # said, not silent
