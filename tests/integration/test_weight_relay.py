"""Relayed weight pushes (``trainer.weight_transport: relay``) between real replica
processes (``python -m rlfleet.rollout.main``, the tiny model, the transformers engine) on
loopback, each reached at the address it registered.

What is checked: a version the trainer streams to one replica reaches the others through it
(the chain trainer -> b -> c with fanout 1: c's answer comes back through b), every replica
serving the same weights a straight push gives; and when a relay parent is SIGKILLed while it
forwards (``rollout.debug_relay_delay_s`` holds it mid-forward), the replicas below it get the
version straight from the trainer (``weight/relay_fallbacks``), their versions only go up,
each serves exactly the pushed weights (its scores equal those after a straight push of the
same weights), and the next relayed push lands.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Iterator

import pytest
import torch
from replica_proc import MODEL, ReplicaProc, replicas_started, start_replica, stop_replica
from safetensors.torch import load_file

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.rollout.client import PreparedUpdate, RolloutClient
from rlfleet.rollout.types import ReplicaStatus, ScoredSequence, ScoreRequest
from rlfleet.trainer.weight_relay import RelayWeightTransport
from rlfleet.trainer.weight_sync import WeightSync
from rlfleet.trainer.weight_transport import GrpcWeightTransport

CHUNK_BYTES = 128 * 2**10  # the tiny model's 2.3 MiB in ~18 chunks
PARENT_DELAY_S = 0.3  # per chunk forwarded: the parent forwards for ~5 s
PROBE = ScoreRequest([ScoredSequence([1, 2, 3, 4, 5, 6], [7, 8, 9, 10])])
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module")
def cluster() -> Keys:
    return Keys(f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="module")
def pair(
    redis_server: EmbeddedRedis, cluster: Keys, tmp_path_factory
) -> Iterator[list[ReplicaProc]]:
    """Two replicas for the whole module (b and c)."""
    logs = tmp_path_factory.mktemp("relay")
    with replicas_started(redis_server.url, cluster, ("r-b", "r-c"), logs) as started:
        yield started


class Listed:
    """The replicas a push goes to, in this order (the router's role in a fleet)."""

    def __init__(self, addresses: list[str]) -> None:
        self.clients = [RolloutClient(a) for a in addresses]

    async def list_replicas(self) -> list[ReplicaStatus]:
        return list(await asyncio.gather(*(c.status() for c in self.clients)))

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


def relay_sync(addresses: list[str], fanout: int = 1) -> WeightSync:
    transport = RelayWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, fanout)
    return WeightSync(Listed(addresses), transport)


def scaled(scale: float) -> dict[str, torch.Tensor]:
    state = load_file(str(MODEL / "model.safetensors"))
    return {name: t * scale if t.dim() == 2 else t for name, t in state.items()}


async def scores(address: str, version: int) -> list[list[float]]:
    async with RolloutClient(address) as client:
        request = ScoreRequest(PROBE.sequences, min_weight_version=version)
        return (await client.score_tokens(request)).logprobs


async def straight_scores(address: str, state: dict, version: int) -> list[list[float]]:
    """The scores after a straight (streamed, no relay) push of ``state``."""
    sync = WeightSync(
        Listed([address]), GrpcWeightTransport(RolloutClient, PreparedUpdate.of, 2**20)
    )
    try:
        await sync.push(state, version)
    finally:
        await sync.close()
    return await scores(address, version)


async def versions(addresses: list[str]) -> list[int]:
    listed = Listed(addresses)
    try:
        return [s.weight_version for s in await listed.list_replicas()]
    finally:
        await listed.close()


async def test_a_version_reaches_the_chain_through_its_parent(pair: list[ReplicaProc]) -> None:
    addresses = [p.address for p in pair]
    version = max(await versions(addresses)) + 1
    sync = relay_sync(addresses)
    try:
        metrics = await sync.push(scaled(0.9), version)
    finally:
        await sync.close()
    assert await versions(addresses) == [version, version]
    assert metrics["weight_sync/replicas"] == 2.0 and metrics["weight/relay_fallbacks"] == 0.0
    assert metrics["weight/pause_s/r-c"] > 0  # c's answer came back through b
    relayed = await scores(addresses[1], version)
    assert relayed == await scores(addresses[0], version)
    assert relayed == await straight_scores(addresses[1], scaled(0.9), version + 1)


async def test_a_parent_killed_mid_forward_leaves_its_children_to_the_trainer(
    pair: list[ReplicaProc], redis_server: EmbeddedRedis, cluster: Keys, tmp_path
) -> None:
    delay = f"rollout.debug_relay_delay_s={PARENT_DELAY_S}"
    parent = start_replica(redis_server.url, cluster, "r-p", tmp_path / "p.log", delay)
    children = [p.address for p in pair]
    try:
        before = await versions(children)
        version = max([*before, *await versions([parent.address])]) + 1
        sync = relay_sync([parent.address, *children])  # trainer -> p -> b -> c
        push = asyncio.create_task(sync.push(scaled(1.1), version))
        await asyncio.to_thread(parent.proc.wait_for_line, f"relaying weights v{version}", 60)
        await asyncio.sleep(3 * PARENT_DELAY_S)  # a few chunks into its forward
        assert not push.done() and await versions(children) == before  # mid-forward
        parent.proc.kill()  # SIGKILL to the parent process only
        try:
            metrics = await asyncio.wait_for(push, 120)
        finally:
            await sync.close()
        assert metrics["weight/relay_fallbacks"] == 2.0  # b and c, straight from the trainer
        assert metrics["weight_sync/failed"] == 1.0 and metrics["weight_sync/replicas"] == 2.0
        after = await versions(children)
        assert after == [version, version] and all(
            a > b for a, b in zip(after, before, strict=True)
        )
        served = [await scores(a, version) for a in children]
        assert (
            served[0] == served[1] == await straight_scores(children[0], scaled(1.1), version + 1)
        )
        sync = relay_sync(children)  # the next relayed push lands without the dead parent
        try:
            metrics = await sync.push(scaled(1.2), version + 2)
        finally:
            await sync.close()
        assert metrics["weight/relay_fallbacks"] == 0.0
        assert await versions(children) == [version + 2, version + 2]
    finally:
        stop_replica(parent, signal.SIGKILL)
