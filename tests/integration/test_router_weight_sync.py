"""The trainer's weight sync and ``rlfleet status`` against a real router and real replicas.

Both learn the fleet from ``Router.ListReplicas`` (no Redis), and weight sync learns what
each replica now serves from its ``UpdateWeights`` reply.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from replica_proc import MODEL
from router_fleet import Fleet, add_replica, launch_fleet, teardown
from safetensors.torch import load_file

from rlfleet.common.config import load_config
from rlfleet.common.errors import Unavailable
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import ReplicaState
from rlfleet.status_cli import collect
from rlfleet.trainer.weight_sync import grpc_weight_sync

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = launch_fleet(redis_server, tmp_path_factory.mktemp("weight_sync_fleet"))
    try:
        add_replica(fleet, "wa")
        add_replica(fleet, "wb")
        yield fleet
    finally:
        teardown(fleet)


async def test_push_reaches_every_listed_replica_and_reports_its_version(fleet: Fleet):
    sync = grpc_weight_sync(fleet.address, None, 64)
    state = load_file(str(MODEL / "model.safetensors"))
    try:
        assert len(await sync.wait_for_replicas(2, timeout_s=60)) == 2
        metrics = await sync.push(state, 3)
        assert (metrics["weight_sync/replicas"], metrics["weight_sync/failed"]) == (2.0, 0.0)
        assert sync.versions == {"wa": 3, "wb": 3}
        assert await sync.push(state, 3, only_stale=True) == {"weight_sync/replicas": 0.0}
    finally:
        await sync.close()
    async with RolloutClient(fleet.address) as router:
        listed = await router.list_replicas()
    assert {(r.replica_id, r.weight_version, r.state) for r in listed} == {
        ("wa", 3, ReplicaState.SERVING),
        ("wb", 3, ReplicaState.SERVING),
    }


async def test_wait_for_replicas_without_a_router_says_how_many_came_up():
    sync = grpc_weight_sync(f"127.0.0.1:{free_port()}", None, 64)
    try:
        with pytest.raises(Unavailable, match="only 0 of 1"):
            await sync.wait_for_replicas(1, timeout_s=1.0)
    finally:
        await sync.close()


async def test_status_lists_replicas_from_the_router(fleet: Fleet):
    cluster = f"t{uuid.uuid4().hex[:12]}"  # no trainer anywhere: its line says so
    overrides = [
        f"endpoints.router={fleet.address}",
        f"cluster={cluster}",
        f"endpoints.trainer=127.0.0.1:{free_port()}",
    ]
    lines = await collect(load_config(overrides=overrides, env={}))
    assert lines[0] == f"replicas (2, from router {fleet.address}):"
    assert lines[1].split()[:3] == ["replica", "state", "version"]  # the table's header
    assert [line.split()[0] for line in lines[2:4]] == ["wa", "wb"]
    assert any(line.startswith("trainer: not reachable") for line in lines)
