"""Fetch before the pause, on a real replica process (``python -m rlfleet.rollout.main``,
the tiny model, ``trainer.weight_delta=always`` so it keeps a base for deltas), once with the
transformers engine and once with vLLM (marked ``vllm``; it reloads the whole model after a
delta, the transformers engine writes only the changed elements).

What is checked: while an update's bytes are still arriving the replica serves (state
``serving``, a Generate answered under the old version); the reply reports the pause and
the staging; an element delta lands in the engine's parameters (its greedy answers equal
those after a full push of the same weights) with the pause reported per replica in the
trainer's metrics; a delta the replica refuses (its base differs) changes nothing and the
next delta still lands. The order of the steps is tested in tests/unit/test_update_steps.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import torch
from replica_proc import MODEL, ReplicaProc, replica_for_module
from replica_weights import one_replica_sync, original_weights, replica_transport

from rlfleet.common.errors import FailedPrecondition
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.model import weights
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = [1, 2, 3, 4, 5, 6]
REPLICA_ID = "r-fetch"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def replica(
    request: pytest.FixtureRequest, redis_server: EmbeddedRedis, tmp_path_factory
) -> Iterator[ReplicaProc]:
    extra = (f"rollout.backend={request.param}", "trainer.weight_delta=always")
    yield from replica_for_module(redis_server.url, tmp_path_factory, REPLICA_ID, *extra)


async def greedy(client: RolloutClient) -> tuple[list[int], int]:
    request = GenerateRequest(uuid.uuid4().hex, GREEDY, prompt_token_ids=PROMPT)
    result = await client.generate(request, timeout_s=60)
    return result.completions[0].token_ids, result.weight_version


async def held_stream(
    header: weights.WeightHeader, payload, halfway: asyncio.Event, release: asyncio.Event
) -> AsyncIterator[rollout_pb2.WeightChunk]:
    """The update's header and half its bytes, then a wait for ``release``, then the rest."""
    yield rollout_pb2.WeightChunk(header=convert.header_to_proto(header))
    raw = bytes(payload)
    chunk = max(1, len(raw) // 8)
    for start in range(0, len(raw), chunk):
        if start >= len(raw) // 2 and not halfway.is_set():
            halfway.set()
            await release.wait()
        yield rollout_pb2.WeightChunk(data=raw[start : start + chunk])


async def test_the_replica_serves_while_the_bytes_arrive_and_reports_its_pause(
    replica: ReplicaProc,
) -> None:
    async with RolloutClient(replica.address) as client:
        version = (await client.status()).weight_version
        header, payload = weights.encode(original_weights(), version + 1)
        halfway, release = asyncio.Event(), asyncio.Event()
        update = asyncio.create_task(
            client.send_weight_messages(held_stream(header, payload, halfway, release), 60)
        )
        await asyncio.wait_for(halfway.wait(), 30)
        assert str((await client.status()).state) == "serving"
        _, served_under = await greedy(client)  # answered while the update is half received
        assert served_under == version and not update.done()
        release.set()
        outcome = await update
    assert outcome.version == version + 1
    assert 0 < outcome.pause_seconds < 5 and outcome.prepare_seconds > 0
    assert outcome.load_seconds <= outcome.pause_seconds


def moved(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``state`` with a few elements of every matrix changed (a delta sends them as pairs)."""
    out = {name: t.clone() for name, t in state.items()}
    for tensor in out.values():
        if tensor.dim() == 2:
            flat = tensor.view(-1)
            flat[:: max(1, flat.numel() // 50)] *= scale
    return out


async def test_a_delta_lands_in_the_parameters_and_its_pause_is_in_the_metrics(
    replica: ReplicaProc,
) -> None:
    async with (
        one_replica_sync(replica.address, 2**20, "always") as sync,
        RolloutClient(replica.address) as client,
    ):
        version = (await client.status()).weight_version + 1
        await sync.push(original_weights(), version)  # full: forced, the base from now on
        before, _ = await greedy(client)
        target = moved(original_weights(), -3.0)
        metrics = await sync.push(target, version + 1)
        assert metrics["weight_sync/delta_replicas"] == 1.0
        assert 0 < metrics[f"weight/pause_s/{REPLICA_ID}"] == metrics["weight/pause_s"] < 5
        by_delta, under = await greedy(client)
        assert under == version + 1 and by_delta != before  # the change reached generation
        await sync.push(target, version + 2, force=True)  # the same weights, pushed full
        assert (await greedy(client))[0] == by_delta


async def test_a_refused_delta_changes_nothing_and_the_next_one_lands(
    replica: ReplicaProc,
) -> None:
    async with (
        one_replica_sync(replica.address, 2**20, "always") as sync,
        RolloutClient(replica.address) as client,
    ):
        version = (await client.status()).weight_version + 1
        await sync.push(original_weights(), version)
        before, _ = await greedy(client)
        # planned from weights the replica does not hold: it refuses, and the trainer
        # sends it the full push at once (PushResult.delta False)
        other = original_weights()  # differs from what the replica holds in one 1-D tensor
        name = next(n for n, t in other.items() if t.dim() == 1)
        other[name] = other[name] + 1
        wrong = await _delta_from(other, moved(other, -3.0), version)
        with pytest.raises(FailedPrecondition, match="differ from the trainer"):
            await client.push_prepared(await wrong.streamed())
        assert (await greedy(client)) == (before, version)
        metrics = await sync.push(moved(original_weights(), 0.5), version + 1)
        assert metrics["weight_sync/delta_replicas"] == 1.0  # the base was put back
        assert (await client.status()).weight_version == version + 1


async def _delta_from(base: dict, new: dict, base_version: int):
    """An element delta from ``base`` (as ``base_version``) to ``new``, encoded to stream."""
    planner = replica_transport(2**20, "always")
    first = planner._encode(base, base_version, True, False, False)
    planner._plan_delta(base, first, base_version, False)  # the base it plans from
    encoded = planner._encode(new, base_version + 1, True, False, False)
    return planner._plan_delta(new, encoded, base_version + 1, False).encoded
