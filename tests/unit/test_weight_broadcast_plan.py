"""The broadcast weight transport (``trainer.weight_transport: broadcast``) without servers:
who is a member of a push, when a new epoch (group) starts, who sits out, the header's round
trip, and whole pushes through ``BroadcastWeightTransport`` to in-process replicas that take
their bytes on a real gloo group on loopback (``BroadcastMember``, the replica's side) or
streamed: a refusing or dead member aborts the round at once and everyone is streamed, a
member that leaves the collective makes it fail within the timeout, and a damaged broadcast is
refused by the checksum like a damaged stream. Real replica processes:
tests/integration/test_weight_broadcast.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch

from rlfleet.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlfleet.model import weights
from rlfleet.model.weights_broadcast import BroadcastGroup
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.client import PreparedUpdate
from rlfleet.rollout.types import ReplicaState, ReplicaStatus, UpdateOutcome
from rlfleet.rollout.weight_broadcast import BroadcastMember
from rlfleet.trainer.weight_broadcast import (
    BroadcastResult,
    BroadcastWeightTransport,
    Membership,
    members_of,
    needs_new_epoch,
    to_blame,
)
from rlfleet.trainer.weight_sync import push_metrics
from rlfleet.trainer.weight_transport import PushResult

TIMEOUT_S = 3.0


def status(replica_id: str, version: int = 1) -> ReplicaStatus:
    return ReplicaStatus(replica_id, f"127.0.0.1:{5000 + int(replica_id[1:])}", version,
                         ReplicaState.SERVING, 0, "hf", 0, 0.0)  # fmt: skip


def test_members_are_the_full_push_targets_not_sitting_out() -> None:
    targets = [status(f"r{i}") for i in range(4)]
    membership = Membership(sit_out_pushes=2)
    full = lambda t: t.replica_id != "r1"  # noqa: E731 - r1 takes a delta
    assert [m.replica_id for m in membership.members(targets, full)] == ["r0", "r2", "r3"]
    membership.failed(["r2"])
    assert [m.replica_id for m in membership.members(targets, full)] == ["r0", "r3"]
    assert [m.replica_id for m in membership.members(targets, full)] == ["r0", "r3"]
    assert [m.replica_id for m in membership.members(targets, full)] == ["r0", "r2", "r3"]
    assert membership.sitting_out == {}


def test_a_new_epoch_for_other_members_or_a_broken_group() -> None:
    a, b = members_of([status("r0"), status("r1")]), members_of([status("r1"), status("r0")])
    assert needs_new_epoch(None, False, a)
    assert not needs_new_epoch(a, False, a)
    assert needs_new_epoch(a, True, a)
    assert needs_new_epoch(a, False, b)  # ranks follow the order
    assert needs_new_epoch(a, False, a[:1])


def test_a_round_is_blamed_on_who_answered_unready_else_on_the_late() -> None:
    assert to_blame([1, 2], [2]) == [2]  # 1 was still getting ready when 2 failed
    assert to_blame([1, 2], []) == [1, 2]  # the deadline passed
    assert to_blame([3], [1]) == [3]  # 1 answered after being ready (aborted)


def test_the_group_crosses_the_header_and_refuses_a_mix() -> None:
    header, _ = weights.encode({"w": torch.ones(4)}, 3)
    header.broadcast = BroadcastGroup("10.0.0.1:29500", 4, 9, 2, 3, "gloo", 12.5)
    wire = rollout_pb2.WeightUpdateHeader.FromString(
        convert.header_to_proto(header).SerializeToString()
    )
    assert convert.header_from_proto(wire) == header
    plain, _ = weights.encode({"w": torch.ones(4)}, 3)
    assert convert.header_from_proto(convert.header_to_proto(plain)).broadcast is None
    weights.validate_header(header)
    with pytest.raises(InvalidArgument, match="broadcast"):
        weights.validate_header(dataclasses.replace(header, shared_memory="rlfleet-w-1"))


def test_fallbacks_are_counted_in_the_metrics() -> None:
    results = [
        BroadcastResult("r0", True, 2, bytes=8),
        BroadcastResult("r1", True, 2, bytes=8, broadcast="fallback"),
        BroadcastResult("r2", False, 1, broadcast="fallback"),
    ]
    metrics = push_metrics(results)
    assert metrics["weight/broadcast_fallbacks"] == 2.0 and metrics["weight_sync/failed"] == 1.0
    assert "weight/broadcast_fallbacks" not in push_metrics([PushResult("r0", True, 2)])


class InProcessReplica:
    """A replica's update path in this process: a broadcast header's bytes from its
    ``BroadcastMember``, a streamed one's from the messages; then the checksum."""

    def __init__(
        self, replica_id: str, refuse: bool = False, dead: bool = False, lose_answer: bool = False
    ) -> None:
        self.replica_id, self.refuse, self.dead = replica_id, refuse, dead
        self.lose_answer = lose_answer  # applies a broadcast, then its answer never arrives
        self.member, self.version, self.how = BroadcastMember(), 0, ""
        self.state: dict = {}

    async def push_prepared(self, update: PreparedUpdate) -> UpdateOutcome:
        if self.dead:
            raise Unavailable("connection refused")
        messages = [rollout_pb2.WeightChunk.FromString(m) for m in update.messages]
        header = convert.header_from_proto(messages[0].header)
        if self.refuse and header.broadcast is not None:
            raise FailedPrecondition("not on the group today")
        if header.version <= self.version:  # as a real replica: versions only go up
            raise FailedPrecondition(f"version {header.version} is not newer than {self.version}")
        if header.broadcast is not None:
            payload = await self.member.receive(header)
        else:
            payload = memoryview(b"".join(m.data for m in messages[1:]))
        self.state = {k: v.clone() for k, v in weights.decode(header, payload).items()}
        self.version, self.how = header.version, "broadcast" if header.broadcast else "stream"
        if self.lose_answer and header.broadcast is not None:
            raise Unavailable("connection reset (the answer was lost)")
        return UpdateOutcome(header.version, 0.0, False)

    async def status(self) -> ReplicaStatus:
        return dataclasses.replace(status(self.replica_id), weight_version=self.version)

    async def close(self) -> None:
        pass


@asynccontextmanager
async def broadcasting(
    replicas: dict[str, InProcessReplica],
) -> AsyncIterator[BroadcastWeightTransport]:
    """The trainer's transport to these replicas (each at its ``status`` address), closed after."""
    by_address = {status(r).address: replica for r, replica in replicas.items()}
    connect = by_address.__getitem__
    transport = BroadcastWeightTransport(connect, PreparedUpdate.of, 2**16, TIMEOUT_S)
    try:
        yield transport
    finally:
        await transport.close()


async def push(transport, version: int, dtype: torch.dtype, ids: list[str]) -> list:
    state = {"a": torch.randn(64, 32).to(dtype), "b": torch.arange(10.0).to(dtype)}
    prepared = await transport.prepare(state, version, False)
    try:
        return await transport.deliver(prepared, [status(r, version - 1) for r in ids])
    finally:
        transport.release(prepared, True)


async def test_pushes_go_on_the_group_in_fp32_and_bf16_on_one_epoch() -> None:
    replicas = {r: InProcessReplica(r) for r in ("r1", "r2")}
    async with broadcasting(replicas) as transport:
        for version, dtype in [(1, torch.float32), (2, torch.bfloat16)]:
            results = await push(transport, version, dtype, list(replicas))
            assert [(r.ok, r.broadcast) for r in results] == [(True, "member")] * 2
            assert [(x.version, x.how) for x in replicas.values()] == [(version, "broadcast")] * 2
            assert replicas["r1"].state["a"].dtype == dtype
            assert torch.equal(replicas["r1"].state["a"], replicas["r2"].state["a"])
        assert transport._group.epoch == 1


@pytest.mark.parametrize("why", ["refuse", "dead"])
async def test_a_member_that_is_not_ready_aborts_the_round_at_once(why: str) -> None:
    replicas = {"r1": InProcessReplica("r1"), "r2": InProcessReplica("r2", **{why: True})}
    async with broadcasting(replicas) as transport:
        started = time.monotonic()
        results = await push(transport, 1, torch.float32, ["r1", "r2"])
        assert time.monotonic() - started < TIMEOUT_S
        streamed_ok = why == "refuse"  # it refuses the group only
        assert [(r.ok, r.broadcast) for r in results] == [
            (True, "fallback"),
            (streamed_ok, "fallback"),
        ]
        assert replicas["r1"].how == "stream" and transport.membership.sitting_out == {"r2": 3}
        results = await push(transport, 2, torch.float32, ["r1", "r2"])  # r2 sits out
        assert [r.broadcast for r in results] == ["member", "stream"] and results[0].ok
        assert replicas["r1"].how == "broadcast" and transport._group.epoch == 2


async def test_a_member_whose_answer_was_lost_counts_as_delivered_not_failed() -> None:
    """It applied the broadcast, its answer never came: the fallback push is refused as not
    newer, and its status (serving the version) makes it a delivery, not a failure."""
    replicas = {"r1": InProcessReplica("r1"), "r2": InProcessReplica("r2", lose_answer=True)}
    async with broadcasting(replicas) as transport:
        results = await push(transport, 1, torch.float32, list(replicas))
        assert [(r.ok, r.broadcast) for r in results] == [(True, "member"), (True, "fallback")]
        assert [(x.version, x.how) for x in replicas.values()] == [(1, "broadcast")] * 2
        assert push_metrics(results)["weight_sync/failed"] == 0.0
        replicas["r2"].version = 0  # a replica that restarted on no version: a real failure
        replicas["r2"].dead = True
        results = await push(transport, 2, torch.float32, list(replicas))
        assert not results[1].ok and push_metrics(results)["weight_sync/failed"] == 1.0


async def test_a_member_that_leaves_mid_collective_fails_it_within_the_timeout() -> None:
    replicas = {r: InProcessReplica(r) for r in ("r1", "r2")}
    async with broadcasting(replicas) as transport:
        await push(transport, 1, torch.float32, list(replicas))  # the group is open
        quitter = replicas["r2"].member
        quitter._receive = lambda spec, n: _ready_then_leave(quitter, spec)  # type: ignore[method-assign]
        started = time.monotonic()
        results = await push(transport, 2, torch.float32, list(replicas))
        assert time.monotonic() - started < 4 * TIMEOUT_S
        assert (results[1].ok, results[1].broadcast) == (True, "fallback")
        assert results[0].ok and transport._group.broken  # r1 on the group or streamed
        assert [x.version for x in replicas.values()] == [2, 2]
        assert transport.membership.sitting_out == {}  # nobody to blame: a new epoch next


async def test_a_member_that_lost_its_group_makes_the_next_push_a_new_epoch() -> None:
    replicas = {r: InProcessReplica(r) for r in ("r1", "r2")}
    async with broadcasting(replicas) as transport:
        await push(transport, 1, torch.float32, list(replicas))
        replicas["r2"].member = BroadcastMember()  # restarted at the same address
        started = time.monotonic()
        results = await push(transport, 2, torch.float32, list(replicas))
        assert time.monotonic() - started < TIMEOUT_S  # aborted, not timed out
        assert [(r.ok, r.broadcast) for r in results] == [(True, "fallback")] * 2
        assert transport._group.broken and transport.membership.sitting_out == {}
        results = await push(transport, 3, torch.float32, list(replicas))
        assert [(r.ok, r.broadcast) for r in results] == [(True, "member")] * 2
        assert transport._group.epoch == 2


def _ready_then_leave(member: BroadcastMember, spec: BroadcastGroup) -> memoryview:
    """Say ready, take the go, then leave the group instead of receiving."""
    from rlfleet.rollout import weight_broadcast

    joined = member._join(spec)
    weight_broadcast._handshake(joined.store, spec, opened=True)
    member._leave()
    raise RuntimeError("left the group")


def test_a_damaged_broadcast_is_refused_by_the_checksum() -> None:
    header, payload = weights.encode({"w": torch.ones(4)}, 3)
    damaged = bytearray(payload)
    damaged[0] ^= 1
    with pytest.raises(InvalidArgument):
        weights.decode(header, memoryview(damaged))


async def test_a_bad_group_is_refused_before_anything() -> None:
    header, _ = weights.encode({"w": torch.ones(4)}, 3)
    header.broadcast = BroadcastGroup("127.0.0.1:1", 1, 1, 0, 2)
    with pytest.raises(InvalidArgument, match="rank 0"):
        await BroadcastMember().receive(header)
    header.broadcast = BroadcastGroup("127.0.0.1:1", 1, 1, 1, 2, "mpi")
    with pytest.raises(InvalidArgument, match="backend"):
        await BroadcastMember().receive(header)
