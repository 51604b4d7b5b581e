"""The dashboard's probe on a real Redis: with every role down (their addresses have nobody
listening), it falls back to the replica registry and shows an expired replica down. The rest
of the dashboard without a fleet: tests/unit/test_dashboard.py."""

from __future__ import annotations

from rlfleet.common.config import load_config
from rlfleet.common.redis_server import free_port
from rlfleet.dashboard.probe import FleetProbe
from rlfleet.rollout.registry import ReplicaInfo, ReplicaRegistry
from rlfleet.rollout.types import ReplicaState


def dead_config(tmp_path, redis_url: str, cluster: str):
    """A config on ``redis_url`` whose every endpoint is a port nobody listens on."""
    dead = [
        f"endpoints.{role}=127.0.0.1:{free_port()}"
        for role in ("router", "reward", "refcritic", "trainer")
    ]
    return load_config(
        None,
        [
            f"run_dir={tmp_path}",
            f"redis_url={redis_url}",
            f"cluster={cluster}",
            "dashboard.probe_timeout_s=0.5",
            *dead,
        ],
    )


async def test_probe_falls_back_to_the_registry_and_shows_an_expired_replica_down(
    tmp_path, redis_url, redis_client, cluster_name
):
    from rlfleet.common.keys import Keys

    config = dead_config(tmp_path, redis_url, cluster_name)
    registry = ReplicaRegistry(redis_client, Keys(cluster_name), heartbeat_ttl_s=0.3)
    await registry.register(ReplicaInfo("r-live", "", 7, ReplicaState.SERVING, "hf", 3))
    await registry.register(ReplicaInfo("r-gone", "", 5, ReplicaState.SERVING, "hf", 1))
    await redis_client.delete(Keys(cluster_name).heartbeat("r-gone"))  # as if it died
    await redis_client.xadd(Keys(cluster_name).reward_stream, {"job": "1"})
    await redis_client.xgroup_create(Keys(cluster_name).reward_stream, "reward", id="0")
    probe = FleetProbe(config)
    try:
        fleet = await probe.fleet()
    finally:
        await probe.close()
    assert fleet["replica_source"].startswith("redis registry")
    rows = {r["replica_id"]: r for r in fleet["replicas"]}
    assert rows["r-live"]["up"] and rows["r-live"]["weight_version"] == 7
    assert not rows["r-gone"]["up"] and rows["r-gone"]["state"] == "dead"
    assert fleet["queues"]["reward"] == {"waiting": 1, "pending": 0}
