"""Shared-memory weight payloads (``weights_shm``) and the transport's use of them, with fake
replicas standing in for the gRPC receivers (the real replica path is in
``tests/integration/test_weight_updates.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import replace

import pytest
import torch

from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.model import weights, weights_shm
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.client import PreparedUpdate
from rlfleet.rollout.types import ReplicaState, ReplicaStatus, UpdateOutcome
from rlfleet.trainer.weight_sync import ReplicaDirectory
from rlfleet.trainer.weight_transport import GrpcWeightTransport

pytestmark = pytest.mark.skipif(not weights_shm.available(), reason="no /dev/shm here")


def state() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(5)}


def our_files() -> list[str]:
    return sorted(p.name for p in weights_shm.SHM_DIR.glob(f"{weights_shm.PREFIX}{os.getpid()}-*"))


def test_a_payload_encoded_into_shared_memory_decodes_on_the_other_side():
    shared = weights_shm.SharedPayload
    holder: list[weights_shm.SharedPayload] = []

    def allocate(nbytes: int) -> torch.Tensor:
        holder.append(shared(nbytes))
        return holder[0].tensor()

    header, _ = weights.encode(state(), 3, allocate=allocate)
    try:
        view = weights_shm.open_shared(holder[0].name, header.total_bytes)
        assert not view.readonly  # copy-on-write: tensors view it without a copy
        decoded = weights.decode(header, view)
        assert torch.equal(decoded["a"], state()["a"]) and torch.equal(decoded["b"], state()["b"])
        decoded["b"][0] = 7.0  # private to this mapping
        again = weights.decode(header, weights_shm.open_shared(holder[0].name, header.total_bytes))
        assert again["b"][0] == 1.0
    finally:
        holder[0].close()
    assert our_files() == []


@pytest.mark.parametrize("name", ["../../etc/passwd", "rlfleet-w-1-xyz", "other", ""])
def test_only_payload_file_names_are_opened(name: str):
    with pytest.raises(InvalidArgument, match="not a payload file name"):
        weights_shm.open_shared(name, 8)


def test_a_missing_file_is_not_found_and_a_wrong_size_is_refused():
    with pytest.raises(NotFound, match="not on this machine"):
        weights_shm.open_shared(f"{weights_shm.PREFIX}1-{uuid.uuid4().hex}", 8)
    payload = weights_shm.SharedPayload(16)
    try:
        with pytest.raises(InvalidArgument, match="hold 16 bytes"):
            weights_shm.open_shared(payload.name, 8)
    finally:
        payload.close()


def test_files_of_dead_trainers_are_removed_once_old_and_live_ones_kept():
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = weights_shm.SHM_DIR / f"{weights_shm.PREFIX}{dead.stdout.strip()}-{uuid.uuid4().hex}"
    orphan.write_bytes(b"x")
    live = weights_shm.SharedPayload(4)
    try:
        assert orphan.name not in weights_shm.remove_orphans()  # too young to be sure
        # other processes' orphans may be swept too (a trainer SIGKILLed by another test)
        assert orphan.name in weights_shm.remove_orphans(min_age_s=0)
        assert not orphan.exists() and live.path.exists()
    finally:
        orphan.unlink(missing_ok=True)
        live.close()


class FakeReplica:
    """Answers pushes like a replica: reads the named file if it can, else NOT_FOUND."""

    def __init__(self, sees_shared_memory: bool) -> None:
        self.sees = sees_shared_memory
        self.received: list[str] = []  # "shm" or "stream", per push
        self.refused = 0  # shared-memory headers answered NOT_FOUND

    async def push_prepared(self, update: PreparedUpdate) -> UpdateOutcome:
        first = rollout_pb2.WeightChunk.FromString(update.messages[0])
        header = convert.header_from_proto(first.header)
        if header.shared_memory:
            if not self.sees:
                self.refused += 1
                raise NotFound("not on this machine")
            payload: bytes | memoryview = weights_shm.open_shared(
                header.shared_memory, header.total_bytes
            )
            self.received.append("shm")
        else:
            payload = b"".join(
                rollout_pb2.WeightChunk.FromString(m).data for m in update.messages[1:]
            )
            self.received.append("stream")
        assert torch.equal(weights.decode(header, payload)["a"], state()["a"])
        return UpdateOutcome(header.version, 0.0, True)

    async def close(self) -> None:
        pass


async def test_the_transport_streams_to_replicas_that_cannot_see_the_file_and_remembers():
    replicas = {"local:1": FakeReplica(True), "remote:1": FakeReplica(False)}
    transport = GrpcWeightTransport(replicas.__getitem__, PreparedUpdate.of, 8, shared_memory=True)
    targets = [
        ReplicaStatus(f"r{i}", address, 0, ReplicaState.SERVING, 0, "fake", 0, 0.0)
        for i, address in enumerate(replicas)
    ]
    files = []
    for version in (1, 2):
        results = await transport.push(state(), version, True, targets)
        assert [(r.ok, r.version) for r in results] == [(True, version)] * 2
        files.append(our_files())
    assert len(files[0]) == 1 and files[1] == files[0]  # one file, written again next push
    assert replicas["local:1"].received == ["shm", "shm"]
    assert replicas["remote:1"].received == ["stream", "stream"]
    assert replicas["remote:1"].refused == 1  # asked by reference only the first time
    await transport.close()
    assert our_files() == []


class FailingReplica(FakeReplica):
    """Reads the file, then fails (as a replica that timed out might, still reading)."""

    async def push_prepared(self, update: PreparedUpdate) -> UpdateOutcome:
        await super().push_prepared(update)
        raise TimeoutError("deadline exceeded")


async def test_a_push_that_a_replica_failed_removes_its_file_and_the_next_writes_a_new_one():
    replicas = {"ok:1": FakeReplica(True), "slow:1": FailingReplica(True)}
    transport = GrpcWeightTransport(replicas.__getitem__, PreparedUpdate.of, 8, shared_memory=True)
    targets = [
        ReplicaStatus(f"r{i}", address, 0, ReplicaState.SERVING, 0, "fake", 0, 0.0)
        for i, address in enumerate(replicas)
    ]
    results = await transport.push(state(), 1, True, targets)
    assert [r.ok for r in results] == [True, False]
    assert our_files() == []  # the failed replica may still read it: never written again
    assert all(r.ok for r in await transport.push(state(), 2, True, targets[:1]))
    kept = our_files()
    assert len(kept) == 1
    bigger = {**state(), "c": torch.zeros(3)}  # another size: a new file, the old one removed
    assert all(r.ok for r in await transport.push(bigger, 3, True, targets[:1]))
    assert len(our_files()) == 1 and our_files() != kept
    await transport.close()
    assert our_files() == []


async def test_without_shared_memory_every_replica_gets_the_bytes():
    replica = FakeReplica(True)
    transport = GrpcWeightTransport(lambda _: replica, PreparedUpdate.of, 8)
    target = ReplicaStatus("r0", "local:1", 0, ReplicaState.SERVING, 0, "fake", 0, 0.0)
    assert (await transport.push(state(), 1, True, [target]))[0].ok
    assert replica.received == ["stream"]


async def test_no_room_in_shared_memory_streams_that_push(monkeypatch):
    def full(nbytes: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights_shm, "SharedPayload", full)
    replica = FakeReplica(True)
    transport = GrpcWeightTransport(lambda _: replica, PreparedUpdate.of, 8, shared_memory=True)
    target = ReplicaStatus("r0", "local:1", 0, ReplicaState.SERVING, 0, "fake", 0, 0.0)
    assert (await transport.push(state(), 1, True, [target]))[0].ok
    assert replica.received == ["stream"]


class Directory(ReplicaDirectory):
    """The router's replica list, as ``WeightSync`` asks it."""

    def __init__(self, replicas: list[ReplicaStatus]) -> None:
        self.replicas = replicas

    async def list_replicas(self) -> list[ReplicaStatus]:
        return self.replicas

    async def close(self) -> None:
        pass


async def test_an_async_snapshot_is_the_encoded_payload_not_a_second_copy_of_the_weights():
    from rlfleet.trainer.weight_sync import WeightSync

    replica = FakeReplica(True)
    transport = GrpcWeightTransport(lambda _: replica, PreparedUpdate.of, 8, shared_memory=True)
    target = ReplicaStatus("r0", "local:1", 0, ReplicaState.SERVING, 0, "fake", 0, 0.0)
    sync = WeightSync(Directory([target]), transport)
    weights_now = state()
    snapshot = await sync.snapshot(weights_now, 1)
    assert len(our_files()) == 1  # encoded at once, into the file the replica reads
    weights_now["a"].add_(100.0)  # the next update, in place, before the push went out
    metrics = await snapshot.push()  # FakeReplica checks "a" against the untouched values
    assert metrics["weight_sync/replicas"] == 1.0 and replica.received == ["shm"]
    sync._directory.replicas = [replace(target, weight_version=1)]  # as the router then says
    assert (await snapshot.push(only_stale=True))["weight_sync/replicas"] == 0.0  # a retry
    snapshot.close()
    assert len(our_files()) == 1  # taken by everyone: kept for the next version
    await sync.close()
    assert our_files() == []


def mapped_here(name: str) -> bool:
    return name in open("/proc/self/maps").read()


async def test_the_kept_file_is_not_mapped_by_the_trainer_between_pushes():
    """A spare kept mapped would hold the whole payload in the trainer's resident memory
    through the next update; unmapped, it is remapped and written again by the next push."""
    import gc

    replica = FakeReplica(True)
    transport = GrpcWeightTransport(lambda _: replica, PreparedUpdate.of, 8, shared_memory=True)
    target = ReplicaStatus("r0", "local:1", 0, ReplicaState.SERVING, 0, "fake", 0, 0.0)
    assert (await transport.push(state(), 1, True, [target]))[0].ok
    gc.collect()
    (kept,) = our_files()
    assert not mapped_here(kept)
    changed = {**state(), "b": torch.full((5,), 2.0)}
    assert (await transport.push(changed, 2, True, [target]))[0].ok
    assert our_files() == [kept] and replica.received == ["shm", "shm"]
    header, _ = weights.encode(changed, 2)
    decoded = weights.decode(header, weights_shm.open_shared(kept, header.total_bytes))
    assert torch.equal(decoded["b"], changed["b"])
    await transport.close()
    assert our_files() == []


def resident_kib(name: str) -> int:
    """Resident KiB of this process's mappings of the file ``name``."""
    total, counting = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            counting = line.rstrip().endswith(name)
        elif counting and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_dropped_pages_leave_the_process_and_stay_in_the_file():
    payload = weights_shm.SharedPayload(4 << 20)
    try:
        payload.tensor().fill_(7)
        assert resident_kib(payload.name) >= 4096
        payload.drop_pages()
        assert resident_kib(payload.name) == 0
        assert int(payload.tensor()[12345]) == 7 and int(payload.tensor()[-1]) == 7
    finally:
        payload.close()
