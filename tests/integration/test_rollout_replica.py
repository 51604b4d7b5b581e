"""A real rollout replica process (``python -m rlfleet.rollout.main``) on a real Redis.

What is checked: weight updates change greedy outputs and restoring the weights restores them;
malformed updates are rejected with INVALID_ARGUMENT and change nothing; requests put on the
replica's stream are answered through the queue with the weight version that produced them;
requests cancelled by an update re-run on the new weights; a replica restarted under the same
id finishes what its predecessor left; pause holds the queue. The hf backend runs everything;
the vLLM backend (marked ``vllm``) runs the weight and queue checks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
import torch
from replica_proc import MODEL, ReplicaProc, replica_for_module
from replica_weights import original_weights

from rlfleet.common.errors import ErrorCode, InvalidArgument
from rlfleet.common.queue.workqueue import WorkQueue
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.model import weights
from rlfleet.proto import rollout_pb2
from rlfleet.rollout import convert
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, GenerateResult, SamplingParams

PROMPTS = ["12+34=", "57+18=", "90+9=", "33+66=", "41+27="]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def replica(
    request: pytest.FixtureRequest, redis_server: EmbeddedRedis, tmp_path_factory
) -> Iterator[ReplicaProc]:
    """One replica per backend for the module, on db 0 under its own cluster name."""
    backend = f"rollout.backend={request.param}"
    yield from replica_for_module(redis_server.url, tmp_path_factory, f"r-{request.param}", backend)


async def greedy_outputs(client: RolloutClient, tag: str) -> tuple[list[list[int]], set[int]]:
    """Greedy token ids for every prompt, and the weight versions that produced them."""
    requests = [
        GenerateRequest(f"{tag}-{uuid.uuid4().hex[:8]}", GREEDY, prompt_text=p) for p in PROMPTS
    ]
    results = await asyncio.gather(*[client.generate(r) for r in requests])
    return [r.completions[0].token_ids for r in results], {r.weight_version for r in results}


async def current_version(client: RolloutClient) -> int:
    return (await client.status()).weight_version


async def test_registered_and_serving(replica: ReplicaProc) -> None:
    async with RolloutClient(replica.address) as client:
        status = await client.status()
    assert status.state == "serving" and status.replica_id == replica.replica_id
    assert status.address == replica.address


async def test_weight_update_changes_greedy_outputs_and_restore_returns_them(
    replica: ReplicaProc,
) -> None:
    async with RolloutClient(replica.address) as client:
        version = await current_version(client)
        before, versions = await greedy_outputs(client, "before")
        assert versions == {version}
        torch.manual_seed(0)
        perturbed = {
            k: v + 0.5 * v.std() * torch.randn_like(v) for k, v in original_weights().items()
        }
        reply = await client.push_weights(
            *weights.encode(perturbed, version + 1), chunk_bytes=256 * 1024
        )
        assert reply.version == version + 1 and reply.cache_flushed
        changed, versions = await greedy_outputs(client, "perturbed")
        assert versions == {version + 1} and changed != before
        reply = await client.push_weights(*weights.encode(original_weights(), version + 2))
        restored, versions = await greedy_outputs(client, "restored")
        assert versions == {version + 2} and restored == before
        assert await current_version(client) == version + 2


def bad_updates(version: int) -> dict[str, list[rollout_pb2.WeightChunk]]:
    """Malformed update streams, each as the list of messages a sender would send."""
    original = original_weights()
    header, payload = weights.encode(original, version)
    corrupt = bytearray(payload)
    corrupt[len(corrupt) // 2] ^= 0xFF
    reshaped = dict(original)
    name = "model.layers.0.mlp.down_proj.weight"
    reshaped[name] = original[name].reshape(-1, 2)  # same bytes, wrong shape
    shape_header, shape_payload = weights.encode(reshaped, version)
    head = lambda h: rollout_pb2.WeightChunk(header=convert.header_to_proto(h))  # noqa: E731
    data = lambda b: rollout_pb2.WeightChunk(data=bytes(b))  # noqa: E731
    return {
        "checksum": [head(header), data(corrupt)],
        "truncated": [head(header), data(payload[:-1000])],
        "oversized": [head(header), data(payload), data(b"x")],
        "wrong_shape": [head(shape_header), data(shape_payload)],
        "no_header_first": [data(payload), head(header)],
        "two_headers": [head(header), head(header), data(payload)],
        "empty": [],
    }


async def _stream(messages: list[rollout_pb2.WeightChunk]):
    for message in messages:
        yield message


async def test_bad_updates_are_rejected_and_change_nothing(replica: ReplicaProc) -> None:
    async with RolloutClient(replica.address) as client:
        version = await current_version(client)
        before, _ = await greedy_outputs(client, "bad-before")
        for kind, messages in bad_updates(version + 1).items():
            with pytest.raises(InvalidArgument):
                await client.send_weight_messages(_stream(messages))
            status = await client.status()
            assert (kind, status.weight_version, status.state) == (kind, version, "serving")
        after, versions = await greedy_outputs(client, "bad-after")
    assert after == before and versions == {version}


async def queue_for(replica: ReplicaProc, client: aioredis.Redis) -> WorkQueue:
    return WorkQueue(
        client, replica.keys, replica.keys.rollout_stream(replica.replica_id), "rollout"
    )


async def test_request_on_the_stream_is_answered_through_the_queue(replica: ReplicaProc) -> None:
    client = aioredis.Redis.from_url(replica.redis_url)
    try:
        queue = await queue_for(replica, client)
        request = GenerateRequest(
            f"q-{uuid.uuid4().hex}",
            SamplingParams(n=3, max_tokens=5),
            prompt_token_ids=[1, 5, 6, 14, 7, 8, 15],
        )
        assert await queue.submit(request.request_id, request.to_json())
        assert await queue.submit(f"bad-{uuid.uuid4().hex}", b"not json")
        result = await queue.wait_result(request.request_id, timeout_s=60)
        async with RolloutClient(replica.address) as rollout:
            version = await current_version(rollout)
    finally:
        await client.aclose()
    assert result is not None and result.ok, result
    answer = GenerateResult.from_json(result.payload)
    assert answer.weight_version == version and answer.replica_id == replica.replica_id
    assert len(answer.completions) == 3 and answer.prompt_token_ids == request.prompt_token_ids
    assert all(len(c.logprobs) == len(c.token_ids) for c in answer.completions)


async def test_bad_stream_entry_gets_an_error_answer(replica: ReplicaProc) -> None:
    client = aioredis.Redis.from_url(replica.redis_url)
    try:
        queue = await queue_for(replica, client)
        request_id = f"bad-{uuid.uuid4().hex}"
        await queue.submit(
            request_id, GenerateRequest(request_id, SamplingParams(n=0), [1]).to_json()
        )
        result = await queue.wait_result(request_id, timeout_s=30)
    finally:
        await client.aclose()
    assert result is not None and not result.ok and result.code is ErrorCode.INVALID_ARGUMENT


async def test_invalid_direct_request_is_invalid_argument(replica: ReplicaProc) -> None:
    too_long = SamplingParams(max_tokens=1000)
    async with RolloutClient(replica.address) as client:
        with pytest.raises(InvalidArgument):
            await client.generate(GenerateRequest("long", too_long, prompt_text="1+1="))
        with pytest.raises(InvalidArgument):
            await client.generate(GenerateRequest("", GREEDY, prompt_text="1+1="))
        with pytest.raises(InvalidArgument):  # id 16 is past the 16-token vocabulary
            await client.generate(GenerateRequest("vocab", GREEDY, prompt_token_ids=[1, 16]))
