"""The lease heartbeat thread against a real Redis: a blocked event loop keeps its lease, a
loop hung past ``rollout.loop_stall_s`` loses it, a lapse is reported to the loop."""

from __future__ import annotations

import asyncio
import time

from rlfleet.rollout.heartbeat import HeartbeatThread
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry

TTL_S = 2.0  # seconds: a 1 s lease lapsed under CI load (load 20) with nothing wrong


def info() -> ReplicaInfo:
    return ReplicaInfo("beater", "127.0.0.1:1", 0, "serving", "hf")


async def started(redis_client, keys, stall_s=30.0):
    registry = ReplicaRegistry(redis_client, keys, TTL_S)
    await registry.register(info(), "tok")
    pulse = HeartbeatThread(redis_client, keys, TTL_S, 0.2, stall_s, info)
    lapsed = asyncio.Event()
    pulse.start("tok", lapsed.set)
    return pulse, lapsed


async def test_a_blocked_loop_keeps_its_lease(redis_client, keys):
    pulse, lapsed = await started(redis_client, keys)
    try:
        time.sleep(3 * TTL_S)  # the event loop is blocked, as by a long tokenization
        assert await redis_client.get(keys.heartbeat("beater")) == b"tok"
        assert time.time() - pulse.last_beat < TTL_S and not lapsed.is_set()
    finally:
        pulse.stop()


async def test_a_hung_loop_loses_its_lease(redis_client, keys):
    pulse, _ = await started(redis_client, keys, stall_s=0.5)
    try:
        pulse.tick()  # serving: the stall guard holds from now on
        time.sleep(3 * TTL_S)
        assert await redis_client.get(keys.heartbeat("beater")) is None
        assert pulse.stalled
    finally:
        pulse.stop()


async def test_a_lapse_is_reported_to_the_loop_and_renewing_stops(redis_client, keys):
    pulse, lapsed = await started(redis_client, keys)
    try:
        await redis_client.set(keys.heartbeat("beater"), "someone-else")
        await asyncio.wait_for(lapsed.wait(), 5)
        assert await redis_client.get(keys.heartbeat("beater")) == b"someone-else"
        pulse.hand("someone-else")  # the loop took a new lease: renewed from then on
        await asyncio.sleep(3 * TTL_S)
        assert await redis_client.get(keys.heartbeat("beater")) == b"someone-else"
    finally:
        pulse.stop()
