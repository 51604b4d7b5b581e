"""``IdleWorkers`` counts workers blocked on an empty stream on Valkey *and* Redis 7.0, whose
``XINFO CONSUMERS idle`` never counted them (issue 19, part 2). Fair scoring inside a process:
tests/unit/test_reward_fair_lanes.py.
"""

# ruff: noqa: F811 - `any_redis_url` is a fixture imported from redis_servers
from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from redis_servers import any_redis_url, redis_kind_server  # noqa: F401 - fixtures

from rlfleet.common.keys import Keys
from rlfleet.common.queue.local_first import IdleWorkers
from rlfleet.common.queue.workers import JobWorker, JobWorkerPool
from rlfleet.common.queue.workqueue import Job, WorkQueue


class Blocked(JobWorker):
    async def handle(self, job: Job) -> bytes:
        await asyncio.sleep(30)
        return b""


async def test_idle_workers_sees_blocked_readers_on_every_server(any_redis_url):  # noqa: F811
    client = aioredis.Redis.from_url(any_redis_url)
    keys = Keys("idle")
    queue = WorkQueue(client, keys, keys.reward_stream, "reward")
    pool = JobWorkerPool(lambda: None, stop_after_s=0.1)
    try:
        await queue.ensure_group()
        for name in ("one", "two"):
            pool.add(Blocked(queue, name, read_block_ms=200))
        idle = IdleWorkers(queue, cache_s=0)
        await asyncio.sleep(3.5)  # longer than fresh_ms: block-reads that got nothing
        assert await idle.count() == 2
        await queue.submit("r1", b"work")
        await _until(lambda: _count_is(idle, 1))  # the one holding the job is busy
    finally:
        await pool.stop()
        await client.aclose()


async def _count_is(idle: IdleWorkers, expected: int) -> bool:
    return await idle.count() == expected


async def _until(check, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
