"""The relay tree of one weight push (``trainer.weight_transport: relay``), and what the
replicas in it report back.

Why a tree: streamed to every replica by the trainer, one version crosses the trainer's link
once per replica. In a relay the trainer streams it to ``fanout`` replicas only, and each of
them forwards the same bytes, chunk by chunk as they arrive, to up to ``fanout`` others, and
so on (the header of each forward names the receiver's own subtree). The trainer's link then
carries the model ``fanout`` times however many replicas there are, and the depth grows as
log_fanout(N). Every replica verifies the checksum of what it received before applying it,
so a broken parent can make a child miss a version, never serve a damaged or mixed one; the
trainer pushes straight to every replica the tree did not deliver (``weight/relay_fallbacks``).

Plain dataclasses (no torch, no gRPC): the trainer builds the tree, ``rollout.convert`` puts it
into ``WeightUpdateHeader.relay`` and the results into ``UpdateWeightsResponse.relayed``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MAX_RELAY_NODES = 4096
"""The most replicas one header's relay tree may name (a bound on a header's size)."""


@dataclass(frozen=True)
class RelayTarget:
    """A replica an update is forwarded to, and the replicas that one forwards it to."""

    replica_id: str
    address: str
    """As the replica registered it (``host:port``); replicas dial each other by it."""
    children: tuple[RelayTarget, ...] = ()


@dataclass
class RelayResult:
    """What one replica below the receiver of a relayed update made of it."""

    replica_id: str
    ok: bool
    version: int = 0
    """The version it serves after the update (when ``ok``)."""
    error: str = ""
    pause_seconds: float = 0.0


def relay_tree(replicas: Sequence[tuple[str, str]], fanout: int) -> list[RelayTarget]:
    """The roots (the first ``fanout`` of ``replicas``, (replica id, address) pairs), each with
    its subtree: the rest hang below breadth first, each replica forwarding to at most
    ``fanout`` others (node ``i``'s children are ``fanout * (i + 1) ... fanout * (i + 2) - 1``).
    """
    if fanout < 1:
        raise ValueError(f"relay fanout must be >= 1, got {fanout}")

    def node(index: int) -> RelayTarget:
        first = fanout * (index + 1)
        children = range(first, min(len(replicas), first + fanout))
        return RelayTarget(*replicas[index], tuple(node(c) for c in children))

    return [node(i) for i in range(min(fanout, len(replicas)))]


def walk(targets: Sequence[RelayTarget]) -> Iterator[RelayTarget]:
    """Every target in ``targets`` and below, depth first."""
    for target in targets:
        yield target
        yield from walk(target.children)


def count(targets: Sequence[RelayTarget]) -> int:
    return sum(1 for _ in walk(targets))
