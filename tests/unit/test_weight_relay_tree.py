"""The relay tree of a weight push (``trainer.weight_transport: relay``): its shape, how it
travels in the update's header and answer, the config that picks it, and a relaying
replica's forwards when a child dies or the bytes from above stop.

The replica's forwards run against a stand-in ``RolloutClient`` that reads the messages as a
real client stream would (or stops reading, as a dead child does); the real processes,
killed mid-forward, are tests/integration/test_weight_relay.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.config import load_config
from rlfleet.common.errors import InvalidArgument, Unavailable
from rlfleet.model import weights
from rlfleet.model.weights_relay import RelayResult, RelayTarget, count, relay_tree, walk
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.types import UpdateOutcome
from rlfleet.rollout.weight_relay import RelayLinks


def replicas(n: int) -> list[tuple[str, str]]:
    return [(f"r{i}", f"10.0.0.{i}:5000") for i in range(n)]


def depth(targets: list[RelayTarget] | tuple[RelayTarget, ...]) -> int:
    return 1 + max((depth(t.children) for t in targets), default=0) if targets else 0


@pytest.mark.parametrize("fanout", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 15])
def test_every_replica_is_in_the_tree_once_under_the_fanout(fanout: int, n: int) -> None:
    roots = relay_tree(replicas(n), fanout)
    ids = [t.replica_id for t in walk(roots)]
    assert sorted(ids) == sorted(r for r, _ in replicas(n)) and count(roots) == n
    assert len(roots) == min(fanout, n)  # the trainer sends the model this many times
    assert all(len(t.children) <= fanout for t in walk(roots))
    assert [t.replica_id for t in roots] == [f"r{i}" for i in range(len(roots))]


def test_the_tree_is_breadth_first() -> None:
    roots = relay_tree(replicas(8), 2)
    assert [[c.replica_id for c in r.children] for r in roots] == [["r2", "r3"], ["r4", "r5"]]
    assert [c.replica_id for c in roots[0].children[0].children] == ["r6", "r7"]
    assert depth(relay_tree(replicas(14), 2)) == 3  # 2 + 4 + 8
    assert depth(relay_tree(replicas(15), 2)) == 4
    assert depth(relay_tree(replicas(4), 1)) == 4  # a chain


def test_a_fanout_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="fanout"):
        relay_tree(replicas(3), 0)


def header_with(relay: tuple[RelayTarget, ...], shared: str = "") -> weights.WeightHeader:
    import torch

    header, _ = weights.encode({"w": torch.ones(4)}, 3)
    header.relay, header.shared_memory = relay, shared
    return header


def test_the_tree_crosses_the_header_and_the_answer_crosses_back() -> None:
    roots = tuple(relay_tree(replicas(5), 2))
    header = header_with(roots)
    wire = rollout_pb2.WeightUpdateHeader.FromString(
        convert.header_to_proto(header).SerializeToString()
    )
    assert convert.header_from_proto(wire).relay == roots
    relayed = [RelayResult("r2", True, 3, "", 0.01), RelayResult("r3", False, 0, "Unavailable")]
    outcome = UpdateOutcome(3, 0.1, True, 0.02, 0.03, relayed)
    answer = rollout_pb2.UpdateWeightsResponse.FromString(
        convert.outcome_to_proto(outcome).SerializeToString()
    )
    assert convert.outcome_from_proto(answer) == outcome


def test_a_relay_over_shared_memory_or_too_large_is_refused_from_the_header() -> None:
    weights.validate_header(header_with(tuple(relay_tree(replicas(3), 2))))
    with pytest.raises(InvalidArgument, match="relayed"):
        weights.validate_header(header_with(tuple(relay_tree(replicas(3), 2)), "rlfleet-w-1"))
    with pytest.raises(InvalidArgument, match="relayed"):
        weights.validate_header(header_with(tuple(relay_tree(replicas(4097), 64))))


def test_the_transport_is_chosen_in_the_config() -> None:
    trainer = load_config(overrides=["trainer.weight_transport=relay"]).trainer
    assert (trainer.weight_transport, trainer.relay_fanout) == ("relay", 2)
    assert load_config().trainer.weight_transport == "auto"
    trainer = load_config(overrides=["trainer.weight_transport=broadcast"]).trainer
    assert (trainer.weight_transport, trainer.weight_broadcast_timeout_s) == ("broadcast", 30.0)
    with pytest.raises(ValueError, match="weight_shared_memory"):
        load_config(
            overrides=["trainer.weight_transport=shm", "trainer.weight_shared_memory=false"]
        )


class Child:
    """A stand-in client for one child: reads the forwarded messages like a client stream
    (``reads`` of them, then fails like a dead peer when ``dies_after`` is set)."""

    def __init__(self, dies_after: int | None = None) -> None:
        self.received: list[bytes] = []
        self.dies_after = dies_after

    async def push_messages(self, messages: AsyncIterator[bytes], timeout_s=None):
        async for message in messages:
            self.received.append(message)
            if self.dies_after is not None and len(self.received) > self.dies_after:
                raise Unavailable("connection reset")
        header = rollout_pb2.WeightChunk.FromString(self.received[0]).header
        return UpdateOutcome(header.version, 0.0, True, 0.01)

    async def close(self) -> None:
        pass


async def test_a_dead_child_is_reported_and_the_others_get_every_chunk() -> None:
    children = {"a:1": Child(), "b:1": Child(dies_after=2), "c:1": Child()}
    links = RelayLinks(children.__getitem__)
    tree = (RelayTarget("a", "a:1", (RelayTarget("c", "c:1"),)), RelayTarget("b", "b:1"))
    relay = links.start(header_with(tree))
    assert relay is not None
    chunks = [bytes([i]) * 8 for i in range(20)]  # more than a dead child's queue holds
    for chunk in chunks:
        await asyncio.wait_for(relay.forward(chunk), 5)  # never stuck behind the dead one
    results = {r.replica_id: r for r in await relay.finish()}
    assert results["a"].ok and results["a"].version == 3
    assert not results["b"].ok and "connection reset" in results["b"].error
    assert children["a:1"].received[1:] == chunks  # the same bytes, in order
    forwarded = convert.header_from_proto(
        rollout_pb2.WeightChunk.FromString(children["a:1"].received[0]).header
    )
    assert forwarded.relay == (RelayTarget("c", "c:1"),)  # its own subtree only
    assert children["c:1"].received == []  # a's (stand-in) forwards nothing itself


async def test_an_aborted_relay_leaves_no_child_with_a_whole_update() -> None:
    child = Child()
    relay = RelayLinks(lambda address: child).start(header_with((RelayTarget("a", "a:1"),)))
    assert relay is not None
    await relay.forward(b"x" * 8)
    relay.abort()  # the bytes from above stopped
    await asyncio.sleep(0)
    with pytest.raises(asyncio.CancelledError):
        await relay.finish()
    assert len(child.received) <= 2  # header and what had arrived, never the end
