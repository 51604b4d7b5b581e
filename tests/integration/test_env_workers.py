"""Env workers on the env stream of a real Redis: every job is answered once, in order, with a
reclaimed episode's restart counted; a caller that gives up stops the episode being played;
and the env processes share a batch, whichever of them began reading first.

The last is why the lanes of one process take turns at reading (``EnvWorker.read_turn``):
Redis hands a new entry to the reader that blocked first, so a process whose idle lanes all
blocked before another's took whole batches, and a worker-only env process next to the front
door once played 0 of a run's 32 episodes (tests/integration/test_ray_launcher.py).
"""

# ruff: noqa: F811 - `renderer` and `nowhere` are fixtures imported from env_doubles
from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis
from env_doubles import (  # noqa: F401 - renderer and nowhere are fixtures
    NO_MODEL,
    SETTINGS,
    TASK,
    RaisingEnv,
    SlowEnv,
    agent,
    nowhere,
    renderer,
)

from rlfleet.common.queue.workers import JobWorkerPool
from rlfleet.env.runner import EpisodeRunner
from rlfleet.env.service import EnvService, env_queue
from rlfleet.env.types import EpisodeJob
from rlfleet.env.worker import EnvWorker

pytestmark = NO_MODEL
LANES = 8


async def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_every_job_is_answered_once_in_order_and_a_reclaimed_one_counts_a_restart(
    renderer, nowhere, redis_client, keys
):
    config = agent(reclaim_idle_s=0.5)
    service = EnvService(redis_client, keys, config)
    await service.start()
    batch = [EpisodeJob(f"e{i}", TASK) for i in range(5)]
    running = asyncio.create_task(service.run_episodes(batch, SETTINGS))
    queue = env_queue(redis_client, keys)  # a Consumer: the dying worker reads with it
    await wait_for(lambda: _has(queue, len(batch)))
    taken = await queue.read("a-worker-that-dies", 1, 1000)  # read, never answered
    group = JobWorkerPool(lambda: None)
    runner = EpisodeRunner(RaisingEnv, renderer, nowhere, config)
    for lane in range(2):
        group.add(EnvWorker(env_queue(redis_client, keys), runner, f"lane-{lane}", 0.5))
    outcomes = await asyncio.wait_for(running, 60)
    await group.stop()
    assert [o.episode_id for o in outcomes] == [job.episode_id for job in batch]
    assert all("no such task" in o.error for o in outcomes) and not group.crashed
    restarted = {o.episode_id for o in outcomes if o.restarts}
    assert restarted == {_episode_of(taken[0].payload)}
    assert runner.played == len(batch)


async def test_a_caller_that_gives_up_stops_the_episode_being_played(
    renderer, nowhere, redis_client, keys
):
    config = agent(step_timeout_s=30.0, episode_timeout_s=60.0)
    service = EnvService(redis_client, keys, config)
    await service.start()
    group = JobWorkerPool(lambda: None)
    runner = EpisodeRunner(lambda: SlowEnv(30.0), renderer, nowhere, config)
    lane = EnvWorker(env_queue(redis_client, keys), runner, "lane-0", 10.0)
    group.add(lane)
    running = asyncio.create_task(service.run_episodes([EpisodeJob("long", TASK)], SETTINGS))
    queue = env_queue(redis_client, keys)
    await wait_for(lambda: _pending(queue))  # the lane is playing it
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await wait_for(lambda: _withdrawn(lane))
    await group.stop()
    assert service.jobs.withdrawn == 1 and lane.runner.played == 0


async def _pending(queue) -> bool:
    return await queue.pending_count() == 1


async def _withdrawn(lane: EnvWorker) -> bool:
    return lane.withdrawn == 1


async def _has(queue, entries: int) -> bool:
    return await queue.length() >= entries


def _episode_of(payload: bytes) -> str:
    return json.loads(payload)["job"]["episode_id"]


async def test_two_env_processes_share_a_batch_whoever_began_reading_first(
    renderer, nowhere, redis_url, redis_client, keys
):
    """Two processes of 8 lanes each, as ``env.app.start_workers`` builds them (one read turn
    per process, one Redis client each); the first is blocked on the stream before the second
    starts. A batch of 8 episodes is played by both: the first entry goes to the first
    process's reader, the second to the second's, which had blocked next."""
    config = agent()
    service = EnvService(redis_client, keys, config)
    await service.start()
    group, clients, processes = JobWorkerPool(lambda: None), [], []
    try:
        for name in ("front", "worker-only"):
            client = aioredis.Redis.from_url(redis_url, client_name=name)
            clients.append(client)
            runner = EpisodeRunner(RaisingEnv, renderer, nowhere, config)
            turn = asyncio.Lock()
            lanes = [
                EnvWorker(env_queue(client, keys), runner, f"{name}-{i}", 10.0, turn)
                for i in range(LANES)
            ]
            for lane in lanes:
                group.add(lane)
            processes.append(lanes)
            await wait_for(lambda name=name: _blocked_reading(redis_client, name))
        outcomes = await service.run_episodes(
            [EpisodeJob(f"e{i}", TASK) for i in range(8)], SETTINGS
        )
    finally:
        await group.stop()
        for client in clients:
            await client.aclose()
    assert len(outcomes) == 8 and all("no such task" in o.error for o in outcomes)
    played = [sum(lane.answered for lane in lanes) for lanes in processes]
    assert sum(played) == 8 and min(played) > 0, played


async def _blocked_reading(redis: aioredis.Redis, name: str) -> bool:
    """True while a connection named ``name`` is blocked in XREADGROUP (``CLIENT LIST``)."""
    return any(
        c.get("name") == name and c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "")
        for c in await redis.client_list()
    )
