"""The vLLM engine serves a pushed LoRA adapter (a new versioned ``LoRARequest`` per push) the
way the transformers engine serves it merged into its weights: the same greedy tokens, close
log-probs, on vLLM's CPU build. In-process engines (no gRPC): what is under test is the
engine's adapter path; the replica's update RPC is tested with the hf engine elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.engines.vllm import VllmEngine
from rlfleet.rollout.types import SamplingParams
from rlfleet.trainer.lora import adapter_state, build_lora_actor

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-arith"
PROMPTS = [[1, 4, 5, 12, 6, 7, 13], [1, 9, 12, 3, 13], [1, 11, 10, 12, 8, 13]]
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def config(backend: str):
    return load_config(
        overrides=[f"model.path={MODEL}", "model.lora_rank=8", f"rollout.backend={backend}"],
        env={},
    )


def adapter_update(seed: int) -> dict[str, torch.Tensor]:
    """The wire form of an adapter that changes the model (B random, as if trained)."""
    torch.manual_seed(seed)
    actor = build_lora_actor(config("hf"), 0, None)
    with torch.no_grad():
        for name, param in actor.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.3)
    return adapter_state(actor.model)


async def greedy(engine, tag: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        completion = (await engine.generate(f"{tag}-{i}", prompt, GREEDY))[0]
        out.append((list(completion.token_ids), list(completion.logprobs)))
    return out


async def test_vllm_serves_each_pushed_adapter_like_the_hf_engine():
    vllm, hf = VllmEngine(config("vllm")), HFEngine(config("hf"))
    await vllm.start()
    await hf.start()
    try:
        base = await greedy(vllm, "base")
        assert [t for t, _ in base] == [t for t, _ in await greedy(hf, "base")]
        for version, seed in enumerate((1, 2), start=1):  # a second push replaces the first
            update = adapter_update(seed)
            await vllm.load_weights(update)
            await hf.load_weights(update)
            served, merged = await greedy(vllm, f"v{version}"), await greedy(hf, f"v{version}")
            assert [t for t, _ in served] == [t for t, _ in merged]
            for (_, got), (_, want) in zip(served, merged, strict=True):
                assert got == pytest.approx(want, abs=2e-3)
            assert [t for t, _ in served] != [t for t, _ in base], "the adapter changed nothing"
        assert vllm.lora_request is not None and vllm.lora_request.lora_int_id == 2
    finally:
        await vllm.close()
        await hf.close()
