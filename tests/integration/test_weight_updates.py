"""Weight-update safety against a real hf replica process (``python -m rlfleet.rollout.main``).

What is checked: versions only go up (an older or equal one is FAILED_PRECONDITION unless the
header says ``force``); a trainer's first push is forced, so a run resumed from an older
checkpoint still takes over the fleet; NaN weights are INVALID_ARGUMENT and the old weights keep
serving; a header announcing more bytes than the model can hold is refused before its payload
is buffered (the replica's RSS does not grow). And, on the replica core with a real Redis and an
engine that fails midway through a load: the replica leaves routing (``update_failed``) and the
next successful update brings it back.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import replace

import psutil
import pytest
import torch
from redis.asyncio import Redis
from replica_proc import MODEL, ReplicaProc, replica_for_module
from replica_weights import one_replica_sync, original_weights, replica_transport

from rlfleet.common.config import load_config
from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.model import weights, weights_shm
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.client import PreparedUpdate, RolloutClient
from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.replica import Replica
from rlfleet.rollout.types import GenerateRequest, ReplicaState, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module")
def replica(redis_server: EmbeddedRedis, tmp_path_factory) -> Iterator[ReplicaProc]:
    yield from replica_for_module(
        redis_server.url, tmp_path_factory, "r-weights", "rollout.backend=hf"
    )


async def version_and_state(client: RolloutClient) -> tuple[int, str]:
    status = await client.status()
    return status.weight_version, str(status.state)


async def push(client: RolloutClient, version: int, force: bool = False, state=None) -> int:
    header, payload = weights.encode(state or original_weights(), version, force=force)
    return (await client.push_weights(header, payload)).version


async def test_versions_only_go_up_unless_forced(replica: ReplicaProc) -> None:
    async with RolloutClient(replica.address) as client:
        current, _ = await version_and_state(client)
        assert await push(client, current + 2) == current + 2
        for stale in (current + 2, current + 1):
            with pytest.raises(FailedPrecondition, match="not newer"):
                await push(client, stale)
            assert await version_and_state(client) == (current + 2, "serving")
        assert await push(client, current + 1, force=True) == current + 1
        assert await version_and_state(client) == (current + 1, "serving")


async def test_a_resumed_trainer_rolls_replicas_back_then_only_goes_forward(
    replica: ReplicaProc,
) -> None:
    async with RolloutClient(replica.address) as client:
        ahead = (await version_and_state(client))[0] + 5
        assert await push(client, ahead) == ahead  # the replicas outran the checkpoint
    async with one_replica_sync(replica.address) as sync:  # a fresh (resumed) trainer's
        metrics = await sync.push(original_weights(), ahead - 3)  # first push of a (resumed) run
        assert sync.versions == {"r-weights": ahead - 3} and metrics["weight_sync/failed"] == 0
        assert metrics["weight_sync/r-weights/mbytes"] == metrics["weight_sync/mbytes"] > 0
        assert metrics["weight_sync/r-weights/seconds"] > 0
        with pytest.raises(Unavailable, match="no replica accepted"):
            await sync.push(original_weights(), ahead - 4)  # later pushes are not forced
        assert (await sync.push(original_weights(), ahead - 2))["weight_sync/replicas"] == 1.0


async def test_a_shared_memory_push_is_read_from_the_file_and_checked_like_a_stream(
    replica: ReplicaProc,
) -> None:
    """Same machine: the header names one /dev/shm file; the replica reads, verifies and loads
    it (NaN weights in the file are refused like streamed ones, and so are absurd finite ones,
    beyond ``rollout.max_weight_abs``), and the file is gone after."""
    transport = replica_transport(shared_memory=True)
    poisoned, absurd = original_weights(), original_weights()
    poisoned["model.norm.weight"][0] = float("inf")
    absurd["model.norm.weight"][1] = -1e30
    async with RolloutClient(replica.address) as client:
        current, _ = await version_and_state(client)
        request = GenerateRequest(f"shm-{uuid.uuid4().hex[:8]}", GREEDY, prompt_text="12+34=")
        before = (await client.generate(request)).completions[0].token_ids
        target = await client.status()
        [bad] = await transport.push(poisoned, current + 1, True, [target])
        assert not bad.ok and "NaN or inf" in bad.error
        [bad] = await transport.push(absurd, current + 1, True, [target])
        assert not bad.ok and "'model.norm.weight'" in bad.error and "max_weight_abs" in bad.error
        [good] = await transport.push(original_weights(), current + 1, True, [target])
        assert good.ok and good.version == current + 1
        request = GenerateRequest(f"shm-{uuid.uuid4().hex[:8]}", GREEDY, prompt_text="12+34=")
        after = await client.generate(request)
        await transport.close()
    assert after.weight_version == current + 1 and after.completions[0].token_ids == before
    assert list(weights_shm.SHM_DIR.glob(f"{weights_shm.PREFIX}{os.getpid()}-*")) == []


async def test_a_shared_memory_header_naming_no_file_is_not_found_and_takes_no_chunks(
    replica: ReplicaProc,
) -> None:
    header, payload = weights.encode(original_weights(), 10**6)
    missing = replace(header, shared_memory=f"{weights_shm.PREFIX}1-{uuid.uuid4().hex}")
    async with RolloutClient(replica.address) as client:
        current = await version_and_state(client)
        with pytest.raises(NotFound, match="not on this machine"):
            await client.push_prepared(PreparedUpdate.of(missing, b"", 2**20))
        with pytest.raises(InvalidArgument, match="takes no data chunks"):
            await client.push_prepared(PreparedUpdate.of(missing, payload, 2**20))
        with pytest.raises(InvalidArgument, match="not a payload file name"):
            named = replace(header, shared_memory="../../etc/passwd")
            await client.push_prepared(PreparedUpdate.of(named, b"", 2**20))
        assert await version_and_state(client) == current


async def test_nan_weights_are_refused_and_the_old_ones_keep_serving(replica: ReplicaProc) -> None:
    poisoned = original_weights()
    poisoned["model.norm.weight"][3] = float("nan")
    async with RolloutClient(replica.address) as client:
        current, _ = await version_and_state(client)
        with pytest.raises(InvalidArgument, match="NaN or inf"):
            await push(client, current + 1, state=poisoned)
        assert await version_and_state(client) == (current, "serving")
        request = GenerateRequest(f"nan-{uuid.uuid4().hex[:8]}", GREEDY, prompt_text="12+34=")
        result = await client.generate(request)
    assert result.weight_version == current and result.completions[0].token_ids


async def oversized_stream(version: int, chunks: int) -> AsyncIterator[rollout_pb2.WeightChunk]:
    """A well-formed header announcing 1 GiB (far more than the tiny model), then data."""
    big = weights.TensorEntry("model.embed_tokens.weight", "float32", (2**28,), 0, 2**30)
    header = weights.WeightHeader(version, [big], 2**30, "crc32:00000000")
    yield rollout_pb2.WeightChunk(header=convert.header_to_proto(header))
    block = bytes(4 * 2**20)
    for _ in range(chunks):
        yield rollout_pb2.WeightChunk(data=block)


async def test_an_oversized_update_is_refused_before_its_bytes_are_buffered(
    replica: ReplicaProc,
) -> None:
    process = psutil.Process(replica.proc.pid)
    async with RolloutClient(replica.address) as client:
        current, _ = await version_and_state(client)
        rss_before = process.memory_info().rss
        with pytest.raises(InvalidArgument, match="larger than this model"):
            await client.send_weight_messages(oversized_stream(current + 1, chunks=32))
        grown = process.memory_info().rss - rss_before
        assert await version_and_state(client) == (current, "serving")
    # 128 MiB were sent after the header. The replica reads them (so that the client sees the
    # refusal, not gRPC's INTERNAL) and keeps none. Buffering them would grow it by at least
    # 128 MiB; the allocator may keep some of the freed 4 MiB chunk buffers (up to ~30 MiB
    # measured), so the bound is half of what was sent.
    assert grown < 64 * 2**20, f"replica RSS grew by {grown / 2**20:.1f} MiB"


class HalfLoadingEngine(Engine):
    """Generates nothing; its first load fails midway (as a real one might on a bad device)."""

    name = "half-loading"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.loads = 0

    async def start(self) -> None:
        return None

    async def generate(self, request_id, prompt_token_ids, sampling):
        raise AssertionError("no work is routed here in this test")

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.loads += 1
        if self.loads == 1:
            raise RuntimeError("device error halfway through the copy")

    async def flush_cache(self) -> bool:
        return True

    async def abort(self, request_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_a_failed_load_leaves_routing_until_a_retry_succeeds(redis_url: str) -> None:
    config = load_config(overrides=[f"model.path={MODEL}"], env={})
    redis = Redis.from_url(redis_url)
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    core = Replica(config, HalfLoadingEngine(config), redis, keys, "r-half", "127.0.0.1:1")
    try:
        await core.start()
        state = {"w": torch.ones(4)}
        with pytest.raises(RuntimeError, match="halfway"):
            await core.update_weights(*weights.encode(state, 1))
        registered = await redis.hget(keys.replica("r-half"), "state")
        assert (core.state, registered, core.version) == (
            ReplicaState.UPDATE_FAILED,
            b"update_failed",
            0,
        )
        assert (await core.update_weights(*weights.encode(state, 1))).version == 1
        assert core.state is ReplicaState.SERVING
        assert await redis.hget(keys.replica("r-half"), "state") == b"serving"
    finally:
        await asyncio.wait_for(core.shutdown(grace_s=0), 30)
        await redis.aclose()


@pytest.fixture(scope="module")
def delta_replica(redis_server: EmbeddedRedis, tmp_path_factory) -> Iterator[ReplicaProc]:
    """A replica that keeps its base weights (``trainer.weight_delta=always``)."""
    yield from replica_for_module(
        redis_server.url,
        tmp_path_factory,
        "r-delta",
        "rollout.backend=hf",
        "trainer.weight_delta=always",
    )


async def greedy(client: RolloutClient) -> tuple[int, list[int]]:
    request = GenerateRequest(f"delta-{uuid.uuid4().hex[:8]}", GREEDY, prompt_text="12+34=")
    result = await client.generate(request)
    return result.weight_version, list(result.completions[0].token_ids)


async def test_a_delta_push_serves_what_the_full_push_serves_and_falls_back_when_refused(
    delta_replica: ReplicaProc,
) -> None:
    """Only the changed tensor travels, and the replica then answers as after the full push;
    a replica on another version gets the full push; one whose base content differs from the
    trainer's refuses the delta (full checksum) and is sent the full push in the same push."""
    transport = replica_transport(delta="always")
    changed = original_weights()
    changed["model.norm.weight"].mul_(-3.0)  # enough to change what greedy decoding says
    async with RolloutClient(delta_replica.address) as client:
        base = (await version_and_state(client))[0] + 1
        [first] = await transport.push(
            original_weights(), base, True, [await client.status()], True
        )
        assert first.ok and not first.delta
        before = await greedy(client)
        [by_delta] = await transport.push(changed, base + 1, True, [await client.status()])
        assert by_delta.ok and by_delta.delta and by_delta.bytes < first.bytes / 10
        after_delta = await greedy(client)
        assert await push(client, base + 1, force=True, state=changed) == base + 1  # full
        assert after_delta == await greedy(client) and after_delta[1] != before[1]
        # another trainer wrote the same version number with other weights (in a tensor the
        # next delta leaves out): the delta is refused, the full push sent instead
        other = original_weights()
        other["model.embed_tokens.weight"].mul_(0.5)
        assert await push(client, base + 1, force=True, state=other) == base + 1
        [fallback] = await transport.push(
            original_weights(), base + 2, True, [await client.status()]
        )
        assert fallback.ok and not fallback.delta and fallback.bytes == first.bytes
        assert (await greedy(client))[1] == before[1]
    await transport.close()
