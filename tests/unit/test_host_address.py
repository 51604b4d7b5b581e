"""rlfleet.common.host_address: a peer is on this host by its address, not by its hostname;
and the weight transport streams to a replica whose address is another host's without first
offering it the shared-memory file (which a namespace sharing /dev/shm could open)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from rlfleet.common.host_address import is_own_ip, on_this_host, split_host
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.client import PreparedUpdate
from rlfleet.rollout.types import ReplicaState, ReplicaStatus, UpdateOutcome
from rlfleet.trainer.weight_transport import GrpcWeightTransport

OTHER_HOST = "198.51.100.77"
"""A documentation-range address no interface of this machine holds (checked below)."""


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("10.1.2.3:50051", "10.1.2.3"),
        ("[::1]:50051", "::1"),
        ("replica-0:7000", "replica-0"),
        ("::1", "::1"),
        ("localhost", "localhost"),
    ],
)
def test_split_host(address, host):
    assert split_host(address) == host


@pytest.mark.parametrize("address", ["127.0.0.1:1", "127.0.0.2:5", "[::1]:9", "localhost:80"])
def test_loopback_is_this_host(address):
    assert on_this_host(address) is True


def test_an_address_of_this_namespace_is_this_host():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("127.0.0.1", 9))
        own = probe.getsockname()[0]
    assert on_this_host(f"{own}:50051") is True


def test_an_address_no_interface_holds_is_another_host():
    assert not is_own_ip(OTHER_HOST), "this machine holds the test's foreign address"
    assert on_this_host(f"{OTHER_HOST}:50051") is False


def test_a_name_is_not_looked_up_and_stays_unknown():
    assert on_this_host(f"{socket.gethostname()}:50051") is None
    assert on_this_host("rollout-3.fleet:7000") is None


class Replica:
    """Records how each push reached it; it could read the shared file (as a namespace that
    shares /dev/shm could), so only the address can tell the transport to stream."""

    def __init__(self) -> None:
        self.received: list[str] = []

    async def push_prepared(self, update: PreparedUpdate) -> UpdateOutcome:
        first = rollout_pb2.WeightChunk.FromString(update.messages[0])
        header = convert.header_from_proto(first.header)
        self.received.append("shm" if header.shared_memory else "stream")
        return UpdateOutcome(header.version, 0.0, True)

    async def close(self) -> None:
        pass


def test_the_transport_streams_to_another_hosts_address_and_shares_memory_with_loopback():
    replicas = {"127.0.0.1:7001": Replica(), f"{OTHER_HOST}:7001": Replica()}
    transport = GrpcWeightTransport(replicas.__getitem__, PreparedUpdate.of, 8, shared_memory=True)
    if not transport._shared_memory:
        pytest.skip("no writable /dev/shm here: every push is streamed anyway")
    targets = [
        ReplicaStatus(f"r{i}", address, 0, ReplicaState.SERVING, 0, "fake", 0, 0.0)
        for i, address in enumerate(replicas)
    ]

    async def two_pushes() -> None:
        for version in (1, 2):
            results = await transport.push({"a": torch.arange(6.0)}, version, True, targets)
            assert all(r.ok for r in results)
        await transport.close()

    asyncio.run(two_pushes())
    assert replicas["127.0.0.1:7001"].received == ["shm", "shm"]
    assert replicas[f"{OTHER_HOST}:7001"].received == ["stream", "stream"]
