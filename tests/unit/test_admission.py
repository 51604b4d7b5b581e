"""Admission control (a bounded queue per replica) and multi-address gRPC targets: pure logic."""

from __future__ import annotations

import pytest

from rlfleet.common.errors import ErrorCode, ResourceExhausted, code_of
from rlfleet.common.grpc_client import channel_target
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaInfo
from rlfleet.rollout.router.admission import admit
from rlfleet.rollout.types import ReplicaState


def snapshot(inflight: dict[str, int], draining: set[str] | None = None) -> RegistrySnapshot:
    replicas = [
        ReplicaInfo(rid, f"h:{i}", 1, ReplicaState.SERVING, alive=True)
        for i, rid in enumerate(sorted(inflight))
    ]
    return RegistrySnapshot(replicas, dict(inflight), draining or set())


def test_full_replicas_leave_the_choice_and_all_full_is_resource_exhausted() -> None:
    snap = snapshot({"a": 2, "b": 1})
    assert admit(snap, 0, 2).draining == {"a"}
    assert admit(snap, 0, None) is snap and admit(snap, 0, 3) is snap
    with pytest.raises(ResourceExhausted, match="max_queue_per_replica=1"):
        admit(snap, 0, 1)
    with pytest.raises(ResourceExhausted, match="no room for 2 requests"):
        admit(snap, 0, 2, count=2)  # a batch needs room for all of it
    assert code_of(ResourceExhausted("x")) is ErrorCode.RESOURCE_EXHAUSTED


def test_only_eligible_replicas_count_and_none_eligible_is_left_to_routing() -> None:
    snap = snapshot({"a": 0, "b": 5}, draining={"a"})
    with pytest.raises(ResourceExhausted):
        admit(snap, 0, 5)  # the idle one is drained: no room
    assert admit(snap, 2, 5) is snap  # nobody at version 2: routing says why (Unavailable)


def test_channel_target_lists_several_servers_for_round_robin() -> None:
    assert channel_target("localhost:50051") == ("localhost:50051", False)
    assert channel_target("127.0.0.1:1, 10.0.0.2:2") == ("ipv4:127.0.0.1:1,10.0.0.2:2", True)
    assert channel_target("[::1]:1,[::1]:2") == ("ipv6:[::1]:1,[::1]:2", True)
    assert channel_target("localhost:7,127.0.0.1:8")[0].startswith("ipv")
    with pytest.raises(ValueError, match="host:port"):
        channel_target("a:1,b")
    with pytest.raises(ValueError, match="mixes"):
        channel_target("127.0.0.1:1,[::1]:2")
