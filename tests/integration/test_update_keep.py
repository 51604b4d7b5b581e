"""A weight update landing mid-generation, on the replica core with the real transformers
engine, the tiny model and a real Redis: what ``rollout.update_policy`` does to the request.

- ``keep``: the answer is the old weights' greedy tokens up to the update, then exactly what a
  fresh engine holding the new weights generates from the prompt plus those tokens (tokens
  and log-probs): nothing decoded is thrown away, and no token reads KV or state of the old
  weights. Each token's version says which weights sampled it; nothing is counted discarded.
- ``restart``: the answer is the new weights' greedy run from the prompt, and the tokens the
  first run had decoded are counted as discarded.

Why a copy of the tiny model: it answers in three tokens and stops; its copy takes ``<unk>``
(which it never samples) as end-of-sequence, so a greedy run is as long as ``max_tokens`` and
the update lands mid-generation.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from redis.asyncio import Redis
from replica_proc import MODEL
from safetensors.torch import load_file

from rlfleet.common.config import load_config
from rlfleet.common.keys import Keys
from rlfleet.model import weights
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.replica import Replica
from rlfleet.rollout.types import GenerateRequest, SamplingParams

MAX_TOKENS = 48
UNK = 3
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with ``<unk>`` as its end-of-sequence token."""
    target = tmp_path_factory.mktemp("keep") / "model"
    shutil.copytree(MODEL, target)
    for name, key in (("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id")):
        raw = json.loads((target / name).read_text())
        raw[key] = UNK
        (target / name).write_text(json.dumps(raw))
    tok = json.loads((target / "tokenizer_config.json").read_text())
    tok["eos_token"] = "<unk>"
    (target / "tokenizer_config.json").write_text(json.dumps(tok))
    return target


def original(model: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model / "model.safetensors"))


def perturbed(model: Path) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original(model).items()}


def config_for(model: Path, *overrides: str):
    return load_config(
        overrides=[
            f"model.path={model}",
            "rollout.backend=hf",
            "rollout.hf_batch_wait_ms=1",
            *overrides,
        ],
        env={},
    )


@pytest_asyncio.fixture
async def fresh(long_model: Path) -> AsyncIterator[HFEngine]:
    """A second engine, for reference runs under chosen weights."""
    engine = HFEngine(config_for(long_model))
    await engine.start()
    yield engine
    await engine.close()


async def crossed_by_an_update(model: Path, redis_url: str, *overrides: str):
    """(answer, the replica's update counters): one greedy request, new weights (v2) pushed
    once it has decoded a few tokens under v1."""
    config = config_for(model, *overrides)
    redis, engine = Redis.from_url(redis_url), HFEngine(config)
    core = Replica(
        config, engine, redis, Keys(f"t{uuid.uuid4().hex[:12]}"), "r-keep", "127.0.0.1:1"
    )
    try:
        await core.start()
        await core.update_weights(*weights.encode(original(model), 1))
        request = GenerateRequest(
            "q1", SamplingParams(temperature=0, max_tokens=MAX_TOKENS), prompt_text="12+34="
        )
        answer = asyncio.create_task(core.generate_direct(request))
        while not any(engine.has_started(key) for key in list(engine._requests)):
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.03)  # a few decoding steps under v1
        await core.update_weights(*weights.encode(perturbed(model), 2))
        return await asyncio.wait_for(answer, 60), core.inflight.gate.stats
    finally:
        await asyncio.wait_for(core.shutdown(grace_s=0), 30)
        await redis.aclose()


async def test_keep_continues_under_the_new_weights_exactly_as_a_fresh_engine(
    long_model: Path, redis_url: str, fresh: HFEngine
) -> None:
    result, stats = await crossed_by_an_update(long_model, redis_url, "rollout.update_policy=keep")
    [c] = result.completions
    old = c.weight_versions.count(1)
    assert 0 < old < MAX_TOKENS, "the update did not land mid-generation"
    assert c.weight_versions == [1] * old + [2] * (MAX_TOKENS - old)
    assert len(c.token_ids) == len(c.logprobs) == MAX_TOKENS and c.finish_reason == "length"
    assert result.weight_version == 1  # the oldest token's
    prompt = fresh.encode("12+34=")
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    [before] = await fresh.generate("ref-old", prompt, greedy)
    assert c.token_ids[:old] == before.token_ids[:old]
    assert c.logprobs[:old] == pytest.approx(before.logprobs[:old], abs=1e-5)
    await fresh.load_weights(perturbed(long_model))
    rest = SamplingParams(temperature=0, max_tokens=MAX_TOKENS - old)
    [after] = await fresh.generate("ref-new", prompt + c.token_ids[:old], rest)
    assert c.token_ids[old:] == after.token_ids
    assert c.logprobs[old:] == pytest.approx(after.logprobs, abs=1e-5)
    assert (stats.tokens_discarded, stats.requests_restarted) == (0, 0)
    assert (stats.requests_resumed, stats.tokens_kept) == (1, old)


async def test_restart_reruns_from_scratch_and_counts_the_tokens_thrown_away(
    long_model: Path, redis_url: str, fresh: HFEngine
) -> None:
    result, stats = await crossed_by_an_update(
        long_model, redis_url, "rollout.update_policy=restart", "rollout.drain_timeout_s=0"
    )
    [c] = result.completions
    assert c.weight_versions == [2] * MAX_TOKENS and result.weight_version == 2
    await fresh.load_weights(perturbed(long_model))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    [ref] = await fresh.generate("ref", fresh.encode("12+34="), greedy)
    assert c.token_ids == ref.token_ids
    assert stats.requests_restarted == 1 and 0 < stats.tokens_discarded < MAX_TOKENS


VLLM_POSITIONS, VLLM_TOKENS = 512, 400
"""vLLM decodes the tiny model fast: a 400-token run lasts long enough for the update to land
inside it whatever the machine's load (the copy's positions are raised; RoPE, weights as is)."""


@pytest.fixture
def vllm_model(long_model: Path, tmp_path: Path) -> Path:
    target = tmp_path / "vllm-model"
    shutil.copytree(long_model, target)
    raw = json.loads((target / "config.json").read_text())
    raw["max_position_embeddings"] = VLLM_POSITIONS
    (target / "config.json").write_text(json.dumps(raw))
    return target


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
async def test_keep_on_vllm_continues_aborted_requests_under_the_new_weights(
    vllm_model: Path, redis_url: str
) -> None:
    """vLLM's abort answers with the tokens decoded so far; ``keep`` continues them. A greedy
    request's kept part equals the old weights' greedy run, its continuation the new weights'
    greedy run from prompt + kept tokens (same engine, cache flushed at the update), to the
    same end (the new weights may reach ``<unk>``, the copy's end, before ``max_tokens``); a
    sampled request with ``n = 2`` comes back with both samples, each token stamped."""
    from rlfleet.rollout.engines.vllm import VllmEngine

    config = config_for(
        vllm_model,
        "rollout.backend=vllm",
        "rollout.update_policy=keep",
        f"rollout.max_model_len={VLLM_POSITIONS}",
    )
    redis, engine = Redis.from_url(redis_url), VllmEngine(config)
    core = Replica(
        config, engine, redis, Keys(f"t{uuid.uuid4().hex[:12]}"), "r-vkeep", "127.0.0.1:1"
    )
    greedy = SamplingParams(temperature=0, max_tokens=VLLM_TOKENS)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=VLLM_TOKENS)
    try:
        await core.start()
        await core.update_weights(*weights.encode(original(vllm_model), 1))
        prompt = engine.encode("12+34=")
        [before] = await engine.generate("ref-old", prompt, greedy)
        one = asyncio.create_task(core.generate_direct(GenerateRequest("g", greedy, prompt)))
        two = asyncio.create_task(core.generate_direct(GenerateRequest("s", sampled, prompt)))
        while len(engine._live) < 2:
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.1)  # some decoding steps under v1
        await core.update_weights(*weights.encode(perturbed(vllm_model), 2))
        first, second = await asyncio.wait_for(asyncio.gather(one, two), 120)
        [c] = first.completions
        old, total = c.weight_versions.count(1), len(c.token_ids)
        assert 0 < old < total, "the update did not land mid-generation"
        assert c.weight_versions == [1] * old + [2] * (total - old)
        assert len(c.logprobs) == total and c.finish_reason in ("length", "stop")
        assert c.token_ids[:old] == before.token_ids[:old]
        assert c.logprobs[:old] == pytest.approx(before.logprobs[:old], abs=1e-4)
        rest = SamplingParams(temperature=0, max_tokens=VLLM_TOKENS - old)
        [after] = await engine.generate("ref-new", prompt + c.token_ids[:old], rest)
        assert c.token_ids[old:] == after.token_ids and c.finish_reason == after.finish_reason
        assert c.logprobs[old:] == pytest.approx(after.logprobs, abs=1e-4)
        # sampled at temperature 1 the copy may draw <unk> (its end): a sample ends anywhere
        assert len(second.completions) == 2
        for s in second.completions:
            assert len(s.token_ids) == len(s.logprobs) == len(s.weight_versions) <= VLLM_TOKENS
            assert s.weight_versions == sorted(s.weight_versions)
            assert s.finish_reason == "length" or s.token_ids[-1] == UNK
        stats = core.inflight.gate.stats
        assert (stats.tokens_discarded, stats.requests_restarted) == (0, 0)
        assert stats.requests_resumed >= 1 and stats.tokens_kept >= old
    finally:
        await asyncio.wait_for(core.shutdown(grace_s=0), 30)
        await engine.close()
        await redis.aclose()
