"""LoRA: adapter-only pushes, the engine's exact merge, the reference with the adapter off,
the checkpoint's adapter and merged export, and the config rules. Real peft on the shipped tiny
policy; one HF engine for the module."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import InvalidArgument
from rlfleet.model import lora, weights
from rlfleet.model.model_io import load_causal_lm
from rlfleet.rl.sequences import pack_sequences, response_logprobs, unpack_rows
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.trainer.lora import ADAPTER_DIR, adapter_state, build_lora_actor, merged_state

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-arith"
pytestmark = pytest.mark.skipif(
    not (MODEL / "model.safetensors").exists(), reason="tiny model not built"
)
PROMPTS = [[1, 4, 5, 12, 6, 7, 13], [1, 9, 12, 3, 13]]
RESPONSES = [[8, 10, 2], [5, 4, 6, 2]]


def lora_config(*extra: str):
    return load_config(overrides=[f"model.path={MODEL}", "model.lora_rank=4", *extra])


def trained_actor(seed: int = 0, *extra: str):
    """A LoRA actor whose adapter is not the identity (B random: as if it had trained)."""
    torch.manual_seed(seed)
    actor = build_lora_actor(lora_config(*extra), 0, None)
    with torch.no_grad():
        for name, param in actor.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return actor


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_push_holds_only_the_adapter_and_is_much_smaller() -> None:
    actor = trained_actor()
    state = actor.state_dict_for_rollout()
    assert state and lora.is_adapter_update(state)
    base = load_causal_lm(str(MODEL))
    full = {name: p.detach() for name, p in base.named_parameters()}
    adapter_bytes = weights.encode(state, 1)[0].total_bytes
    full_bytes = weights.encode(full, 1)[0].total_bytes
    assert adapter_bytes < 0.15 * full_bytes, (adapter_bytes, full_bytes)
    pairs = lora.adapter_pairs(state)  # every wrapped linear layer, each an [r, in] and [out, r]
    assert set(pairs) <= set(full) and "lm_head.weight" not in pairs
    for name, (a, b) in pairs.items():
        assert a.shape[0] == b.shape[1] == 4 and (b.shape[0], a.shape[1]) == full[name].shape


def test_a_merged_push_is_the_base_with_the_adapter_folded_in() -> None:
    """``model.lora_push=merged``: every weight under the base model's own names, equal to
    peft's ``merge_and_unload`` of the same adapter, and the wrapped ones moved by it."""
    import copy

    actor = trained_actor(0, "model.lora_push=merged")
    state = actor.state_dict_for_rollout()
    assert not lora.is_adapter_update(state)
    base = load_causal_lm(str(MODEL))
    plain = {name: p.detach() for name, p in base.named_parameters()}
    assert set(state) == set(plain)
    merged = copy.deepcopy(actor.model).merge_and_unload()
    expected = {name: p.detach() for name, p in merged.named_parameters()}
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    moved = [name for name in state if not torch.equal(state[name], plain[name])]
    assert moved and set(moved) <= set(lora.adapter_pairs(adapter_state(actor.model)))
    assert merged_state(actor.model).keys() == state.keys()


def test_only_the_adapter_trains() -> None:
    actor = trained_actor()
    assert actor.trainable and all(p.requires_grad for p in actor.trainable)
    names = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)


def test_reference_is_the_base_with_the_adapter_off() -> None:
    actor = trained_actor()
    base = load_causal_lm(str(MODEL))
    packed = pack_sequences(PROMPTS, RESPONSES, 0, torch.device("cpu"))
    with torch.no_grad():
        expected = unpack_rows(response_logprobs(base, packed), packed.response_lengths)
    ref = actor.ref_logprobs(PROMPTS, RESPONSES)
    for got, want in zip(ref, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    policy = actor.logprobs(PROMPTS, RESPONSES)  # the adapter is back on afterwards
    assert any(
        abs(p - r) > 1e-4
        for row, ref_row in zip(policy, ref, strict=True)
        for p, r in zip(row, ref_row, strict=True)
    )


def test_wire_names_are_checked() -> None:
    a, b = torch.zeros(2, 3), torch.zeros(5, 2)
    with pytest.raises(InvalidArgument, match="mixes"):
        lora.is_adapter_update({lora.adapter_name("w", "A"): a, "w": a})
    with pytest.raises(InvalidArgument, match="lacks"):
        lora.adapter_pairs({lora.adapter_name("w", "A"): a})
    with pytest.raises(InvalidArgument, match="do not multiply"):
        lora.adapter_pairs({lora.adapter_name("w", "A"): a, lora.adapter_name("w", "B"): a})
    pairs = lora.adapter_pairs({lora.adapter_name("w", "A"): a, lora.adapter_name("w", "B"): b})
    with pytest.raises(InvalidArgument, match="does not have"):
        lora.check_pairs(pairs, {"v": (5, 3)})
    with pytest.raises(InvalidArgument, match="weight is"):
        lora.check_pairs(pairs, {"w": (3, 5)})


def test_checkpoint_holds_adapter_and_merged_export(tmp_path: Path) -> None:
    from transformers import AutoTokenizer  # noqa: F401 - the tokenizer loader needs it

    from rlfleet.model.model_io import load_tokenizer

    actor = trained_actor()
    actor.save_hf(tmp_path, load_tokenizer(str(MODEL)))
    assert (tmp_path / ADAPTER_DIR / "adapter_config.json").is_file()
    merged = load_causal_lm(str(tmp_path))  # a plain HF model, no peft needed
    ids = PROMPTS[0] + RESPONSES[0]
    assert torch.allclose(logits(merged, ids), logits(actor.model, ids), atol=1e-5)
    resumed = build_lora_actor(lora_config(), 0, tmp_path)
    before, after = actor.state_dict_for_rollout(), resumed.state_dict_for_rollout()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert resumed.trainable  # the resumed adapter trains


def test_config_lora_reference_needs_no_refcritic() -> None:
    config = lora_config("trainer.use_kl_loss=true", "trainer.kl_loss_coef=0.01")
    assert config.needs_reference and config.reference_from_actor
    assert not config.needs_refcritic
    gae = lora_config("trainer.use_kl_loss=true", "algorithm.adv_estimator=gae")
    assert gae.needs_refcritic  # the critic still lives there
    full = load_config(overrides=["trainer.use_kl_loss=true", "trainer.kl_loss_coef=0.01"])
    assert full.needs_refcritic and not full.reference_from_actor
    with pytest.raises(NotImplementedError, match="lora_rank"):
        lora_config("trainer.strategy=ddp", "trainer.world_size=2")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine() -> AsyncIterator[HFEngine]:
    engine = HFEngine(load_config(overrides=[f"model.path={MODEL}", "rollout.backend=hf"]))
    await engine.start()
    yield engine
    await engine.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_engine_merges_adapter_exactly(engine: HFEngine) -> None:
    ids = PROMPTS[1] + RESPONSES[1]
    base_logits = logits(engine.model, ids)
    first, second = trained_actor(1), trained_actor(2, "model.target_modules=[q_proj,v_proj]")
    for actor in (first, second, first):  # absolute updates: no drift from the previous one
        await engine.load_weights(adapter_state(actor.model))
        assert torch.allclose(logits(engine.model, ids), logits(actor.model, ids), atol=1e-5)
    # the base weights second's adapter did not touch came back exactly
    params = dict(engine.model.named_parameters())
    untouched = load_causal_lm(str(MODEL)).state_dict()
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    await engine.load_weights(adapter_state(second.model))
    assert torch.equal(params[k_proj], untouched[k_proj])
    # a full update is the new base: the adapter is forgotten
    full = {k: v for k, v in untouched.items() if k != "lm_head.weight"}
    await engine.load_weights(full)
    assert torch.allclose(logits(engine.model, ids), base_logits, atol=0)
    assert not engine.adapter_merged
    bad = adapter_state(first.model)
    bad[lora.adapter_name("model.nope.weight", "A")] = torch.zeros(4, 128)
    bad[lora.adapter_name("model.nope.weight", "B")] = torch.zeros(128, 4)
    with pytest.raises(InvalidArgument):
        await engine.load_weights(bad)
    assert torch.allclose(logits(engine.model, ids), base_logits, atol=0)


@pytest.mark.asyncio(loop_scope="module")
async def test_engine_serves_a_merged_push_as_the_actor(engine: HFEngine) -> None:
    """A merged push is a plain full update: the replica then answers as the LoRA actor does."""
    ids = PROMPTS[0] + RESPONSES[0]
    actor = trained_actor(4, "model.lora_push=merged")
    await engine.load_weights(actor.state_dict_for_rollout())
    assert not engine.adapter_merged
    assert torch.allclose(logits(engine.model, ids), logits(actor.model, ids), atol=1e-5)


def test_wire_form_saved_as_a_peft_adapter_matches_the_actor(tmp_path: Path) -> None:
    """What the vLLM engine hands vLLM (a peft directory from the pushed tensors, B already
    scaled, alpha = r) is the trainer's adapter: peft itself loads it to the same logits."""
    from peft import PeftModel

    actor = trained_actor(3)
    pairs = lora.adapter_pairs(actor.state_dict_for_rollout())
    lora.save_peft_adapter(tmp_path, pairs)
    served = PeftModel.from_pretrained(load_causal_lm(str(MODEL)), str(tmp_path))
    ids = PROMPTS[0] + RESPONSES[0]
    assert torch.allclose(logits(served, ids), logits(actor.model, ids), atol=1e-5)


def test_vllm_lora_switches() -> None:
    from rlfleet.rollout.engines.vllm import lora_engine_args

    assert lora_engine_args(load_config(overrides=[f"model.path={MODEL}"])) == {}
    assert lora_engine_args(lora_config("model.lora_push=merged")) == {}  # plain weights
    args = lora_engine_args(lora_config("model.lora_rank=12"))
    assert args["enable_lora"] and args["max_lora_rank"] == 16
