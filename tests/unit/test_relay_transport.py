"""The trainer's side of a relay push (``RelayWeightTransport``): who gets the tree, who is
pushed straight after it, and what the metrics count.

Stand-in replicas here answer ``UpdateWeights`` as a relaying replica would (each ``Replica``
takes the version if it is newer, and reports the children its header names, each of them
taking it unless marked unreachable from its parent); real replica processes with a parent
killed mid-forward are tests/integration/test_weight_relay.py.
"""

from __future__ import annotations

import torch

from rlfleet.common.errors import FailedPrecondition, Unavailable
from rlfleet.model.weights_relay import RelayResult, RelayTarget
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.client import PreparedUpdate
from rlfleet.rollout.types import ReplicaState, ReplicaStatus, UpdateOutcome
from rlfleet.trainer.weight_relay import RelayedResult, RelayReceiver, RelayWeightTransport
from rlfleet.trainer.weight_sync import push_metrics

STATE = {"w": torch.arange(64, dtype=torch.float32)}


class Replica(RelayReceiver):
    def __init__(self, fleet: dict[str, Replica], name: str) -> None:
        self.fleet, self.name, self.version = fleet, name, 0
        self.dead = False
        self.cut_off = False
        """Its parent's forward to it fails (the parent died, or it is unreachable from it)."""
        self.took_from_parent_anyway = False
        """It took the version from its parent, whose answer never came (the parent died)."""
        self.headers: list[tuple[int, tuple[RelayTarget, ...]]] = []

    def status_now(self) -> ReplicaStatus:
        return ReplicaStatus(
            self.name, self.name, self.version, ReplicaState.SERVING, 0, "hf", 0, 0.0
        )

    async def push_prepared(self, update: PreparedUpdate) -> UpdateOutcome:
        if self.dead:
            raise Unavailable("connection refused")
        header = convert.header_from_proto(
            rollout_pb2.WeightChunk.FromString(update.messages[0]).header
        )
        self.headers.append((header.version, header.relay))
        if header.version <= self.version and not header.force:
            raise FailedPrecondition(f"weight version {header.version} is not newer")
        self.version = header.version
        relayed = [r for child in header.relay for r in self._forward(child, header.version)]
        return UpdateOutcome(self.version, 0.0, True, 0.01, relayed=relayed)

    def _forward(self, child: RelayTarget, version: int) -> list[RelayResult]:
        replica = self.fleet[child.address]
        if replica.took_from_parent_anyway:
            replica.version = version
        if replica.cut_off or replica.dead:
            return [RelayResult(child.replica_id, False, error="Unavailable: reset")]
        replica.version = version
        below = [r for c in child.children for r in replica._forward(c, version)]
        return [RelayResult(child.replica_id, True, version, "", 0.02), *below]

    async def status(self) -> ReplicaStatus:
        if self.dead:
            raise Unavailable("connection refused")
        return self.status_now()

    async def close(self) -> None:
        pass


def fleet(n: int) -> dict[str, Replica]:
    replicas: dict[str, Replica] = {}
    for i in range(n):
        replicas[f"r{i}"] = Replica(replicas, f"r{i}")
    return replicas


async def push(replicas: dict[str, Replica], fanout: int, version: int = 1) -> list:
    transport = RelayWeightTransport(replicas.__getitem__, PreparedUpdate.of, 64, fanout)
    targets = [r.status_now() for r in replicas.values()]
    return await transport.push(STATE, version, True, targets)


async def test_the_trainer_streams_to_fanout_roots_and_the_tree_does_the_rest() -> None:
    replicas = fleet(6)
    results = await push(replicas, 2)
    assert [r.version for r in replicas.values()] == [1] * 6
    streamed_to = [name for name, r in replicas.items() if r.headers]
    assert streamed_to == ["r0", "r1"]  # the trainer's link carries the model twice, not 6x
    assert [c.replica_id for c in replicas["r0"].headers[0][1]] == ["r2", "r3"]
    assert all(isinstance(r, RelayedResult) and r.ok for r in results)
    assert [r.relay for r in results] == ["root", "root", *["parent"] * 4]
    assert push_metrics(results)["weight/relay_fallbacks"] == 0.0


async def test_replicas_the_tree_missed_are_pushed_straight_and_counted() -> None:
    replicas = fleet(6)  # r0 -> r2, r3 (r3 -> nothing); r1 -> r4, r5
    replicas["r3"].cut_off = True
    replicas["r1"].dead = True  # a root: r4 and r5 hear nothing
    results = {r.replica_id: r for r in await push(replicas, 2)}
    assert [r.version for r in replicas.values()] == [1, 0, 1, 1, 1, 1]
    assert not results["r1"].ok and results["r1"].relay == "root"
    assert {n for n, r in results.items() if r.relay == "fallback"} == {"r3", "r4", "r5"}
    assert all(results[n].ok for n in ("r3", "r4", "r5"))
    assert len(replicas["r3"].headers) == 1  # once, straight from the trainer
    metrics = push_metrics(list(results.values()))
    assert metrics["weight/relay_fallbacks"] == 3.0 and metrics["weight_sync/failed"] == 1.0


async def test_a_replica_that_took_it_before_its_parent_failed_counts_as_delivered() -> None:
    replicas = fleet(3)  # a chain: r0 -> r1 -> r2
    replicas["r1"].cut_off = replicas["r1"].took_from_parent_anyway = True
    results = {r.replica_id: r for r in await push(replicas, 1, version=4)}
    assert results["r1"].ok and results["r1"].relay == "fallback" and results["r1"].version == 4
    assert results["r2"].ok and results["r2"].relay == "fallback"  # below r1: straight too
    assert [r.version for r in replicas.values()] == [4, 4, 4]
