"""The janitor's upkeep with a replica that has no stream yet (registered, engine loading):
the sweep must not fail with Redis' "no such key", which switched off the counter
reconciliation while any replica was starting. Also the dead-letter reason says what happened."""

from __future__ import annotations

import logging

from rlfleet.common.config import load_config
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.router.core import RouterCore


async def test_upkeep_with_a_streamless_replica_recounts_the_others(redis_client, keys, caplog):
    registry = ReplicaRegistry(redis_client, keys, 5.0)
    await registry.register(ReplicaInfo("loading", "127.0.0.1:1", 0, "starting", "hf"))
    await registry.register(ReplicaInfo("live", "127.0.0.1:2", 0, "serving", "hf"))
    await redis_client.hset(keys.inflight, mapping={"live": 7, "loading": 3})  # stale counts
    core = RouterCore(redis_client, keys, load_config(env={}))
    with caplog.at_level(logging.WARNING):
        await core.janitor.sweep()  # the first sweep runs the upkeep
    assert "no such key" not in caplog.text
    assert await redis_client.hgetall(keys.inflight) == {}  # both streams hold nothing
    assert not await redis_client.exists(keys.rollout_stream("loading"))
