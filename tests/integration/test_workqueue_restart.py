"""The work queue across an empty Redis restart, simulated by flushing the scratch database:
waiters notice the loss and resubmit, consumers keep the answers they computed.

Why a flush stands for a restart here: what breaks callers is the data vanishing (entries,
bindings, leases, answers), and a flush does exactly that in a millisecond; the real restart
of a real server, with the fleet's processes around it, is tests/integration/test_redis_restart.py.
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from rlfleet.common.keys import Keys
from rlfleet.common.queue.answers import Vanished
from rlfleet.common.queue.workqueue import Finish, WorkQueue, encode_result


@pytest.fixture
async def queue(redis_client: aioredis.Redis, keys: Keys) -> WorkQueue:
    queue = WorkQueue(redis_client, keys, keys.reward_stream, "workers", poll_s=0.1)
    await queue.ensure_group()
    return queue


async def answer_all(queue: WorkQueue, consumer: str = "w1") -> int:
    """Answer whatever is queued now (echo the payload); how many jobs were answered."""
    jobs = await queue.read(consumer, count=100, block_ms=200)
    for job in jobs:
        await queue.complete(job, job.payload)
    return len(jobs)


async def test_epoch_is_one_token_until_the_data_is_lost(queue, redis_client) -> None:
    first = await queue.epoch()
    assert await queue.epoch() == first
    await redis_client.flushdb()
    assert await queue.epoch() != first


async def test_wait_all_resubmits_what_an_empty_restart_lost(queue, redis_client) -> None:
    payloads = {"r1": b"one", "r2": b"two"}
    epoch = await queue.epoch()
    for rid, payload in payloads.items():
        assert await queue.submit(rid, payload)
    assert await answer_all(queue) == 2  # r1 and r2 answered ...
    await redis_client.flushdb()  # ... and lost with everything else
    resubmitted: list[list[str]] = []

    async def resubmit(lost: list[str]) -> None:
        resubmitted.append(lost)
        for rid in lost:
            await queue.submit(rid, payloads[rid])

    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(
        queue.wait_all(list(payloads), loop.time() + 10, 0.1, epoch, resubmit)
    )
    while not resubmitted:
        await asyncio.sleep(0.02)
    while not await answer_all(queue):  # the first read recreates the group the flush took
        pass
    answers = await asyncio.wait_for(waiting, 10)
    assert resubmitted == [["r1", "r2"]]
    assert {rid: a.payload for rid, a in answers.items()} == payloads


async def test_wait_all_without_resubmit_raises_vanished(queue, redis_client) -> None:
    epoch = await queue.epoch()
    assert await queue.submit("r1", b"x")
    await redis_client.flushdb()
    deadline = asyncio.get_running_loop().time() + 10
    with pytest.raises(Vanished) as lost:
        await queue.wait_all(["r1"], deadline, 0.1, epoch)
    assert lost.value.pending == ["r1"]


async def test_bound_waiter_sees_its_request_vanish(queue, redis_client) -> None:
    await queue.submit_bound("r1", b"x", "fp", "sub")
    assert await queue.wait_answer("r1", 0.3, poll_s=0.1, bound=True) is None  # still queued
    await redis_client.flushdb()
    with pytest.raises(Vanished):
        await queue.wait_answer("r1", 10, poll_s=0.1, bound=True)


async def fenced_job(queue, redis_client):
    """A replica's lease "r0" fencing the queue, and job "r1" read under it."""
    lease = queue.keys.heartbeat("r0")
    await redis_client.set(lease, "token")
    queue.fence = (lease, "token")
    assert await queue.submit("r1", b"x")
    [job] = await queue.read("w1", block_ms=200)
    return lease, job


async def test_a_lapsed_lease_still_discards_a_late_answer(queue, redis_client) -> None:
    lease, job = await fenced_job(queue, redis_client)
    await redis_client.delete(lease)  # lapsed on a live server: the work may have moved
    assert await queue.finish(job, encode_result(b"late")) is Finish.FENCED
    assert await queue.get_result("r1") is None


async def test_an_answer_computed_across_an_empty_restart_is_kept(queue, redis_client) -> None:
    lease, job = await fenced_job(queue, redis_client)
    waiter = asyncio.create_task(queue.wait_answer("r1", 10, poll_s=5.0))
    await asyncio.sleep(0.1)  # parked in BLPOP: the stored answer must wake it
    await redis_client.flushdb()  # lease and entry gone with the data
    assert await queue.finish(job, encode_result(b"computed")) is Finish.STORED
    answer = await asyncio.wait_for(waiter, 2)  # woken by the wake-up, not the 5 s poll
    assert answer is not None and answer.payload == b"computed"
    assert await queue.finish(job, encode_result(b"again")) is Finish.DUPLICATE  # answered once
