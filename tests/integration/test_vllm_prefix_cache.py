"""A vLLM replica's prefix-cache counters on ``/metrics``: the same long prompt twice is served
from the cache the second time, and not after a ``FlushCache``.

Why a copy of the tiny model: vLLM's CPU build caches 128-token blocks, and the tiny policy's
config allows only 64 positions, so no prompt it accepts could fill a block. The copy raises
``max_position_embeddings`` (RoPE has no learned positions; the weights are unchanged).
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from replica_proc import MODEL, ReplicaProc, start_replica, stop_replica

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import GenerateRequest, SamplingParams

PROMPT_LEN, MAX_LEN = 300, 320
QUERIED = "rlfleet_rollout_prefix_cache_queried_tokens_total"
HIT = "rlfleet_rollout_prefix_cache_hit_tokens_total"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]


def long_context_model(target: Path, positions: int) -> Path:
    """The tiny model with room for ``positions`` tokens."""
    shutil.copytree(MODEL, target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


@pytest.fixture
def replica(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[tuple[ReplicaProc, str]]:
    model, port = long_context_model(tmp_path / "model", MAX_LEN), free_port()
    proc = start_replica(
        redis_server.url,
        Keys(f"t{uuid.uuid4().hex[:12]}"),
        "pc",
        tmp_path / "pc.log",
        "rollout.backend=vllm",
        f"model.path={model}",
        f"rollout.max_model_len={MAX_LEN}",
        f"rollout.metrics_port={port}",
    )
    try:
        yield proc, f"http://127.0.0.1:{port}/metrics"
    finally:
        stop_replica(proc, signal.SIGKILL)


def counters(url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens, as scraped; a missing family fails the test."""
    text = httpx.get(url, timeout=10).raise_for_status().text
    found = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return found[QUERIED], found[HIT]


async def test_repeated_prompt_is_served_from_the_prefix_cache_until_a_flush(replica) -> None:
    proc, url = replica
    rng = random.Random(7)
    prompt = [1, *(rng.randrange(3, 16) for _ in range(PROMPT_LEN - 1))]

    def request() -> GenerateRequest:
        sampling = SamplingParams(n=1, temperature=0.0, max_tokens=2)
        return GenerateRequest(uuid.uuid4().hex, sampling, prompt_token_ids=prompt)

    async def delta() -> tuple[float, float]:
        """What one more request with the prompt adds to (queried, hit)."""
        before = counters(url)
        await client.generate(request())
        after = counters(url)
        return after[0] - before[0], after[1] - before[1]

    async with RolloutClient(proc.address) as client:
        assert await delta() == (PROMPT_LEN, 0)  # first sight: nothing cached
        queried, hit = await delta()
        assert queried == PROMPT_LEN
        assert PROMPT_LEN // 2 <= hit < PROMPT_LEN  # full blocks; the last token is recomputed
        assert await client.flush_cache()
        assert await delta() == (PROMPT_LEN, 0)
