"""The transformers backend on the shipped tiny model: the Engine contract, for real.

One engine is loaded for the module (a second or two); tests that change its weights put the
originals back before they finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import InvalidArgument
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.types import SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-arith"
EOS = 2
pytestmark = [
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[HFEngine]:
    config = load_config(
        overrides=[f"model.path={MODEL}", "rollout.backend=hf", "rollout.hf_batch_wait_ms=20"]
    )
    engine = HFEngine(config)
    await engine.start()
    yield engine
    await engine.close()


def original_weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def prompt(engine: HFEngine, a: int, b: int) -> list[int]:
    return engine.encode(f"{a}+{b}=")


def recomputed_logprobs(engine: HFEngine, prompt_ids: list[int], tokens: list[int], temp: float):
    """log_softmax(logits / T) of each sampled token, from one plain forward pass."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    logp = torch.log_softmax(logits / (temp or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()


async def test_n_completions_with_logprobs_and_finish_reasons(engine: HFEngine) -> None:
    ids = prompt(engine, 12, 34)
    completions = await engine.generate(
        "a", ids, SamplingParams(n=5, temperature=1.0, max_tokens=8)
    )
    assert len(completions) == 5
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) >= 1
        assert all(lp <= 0 for lp in c.logprobs)
        assert c.logprobs == pytest.approx(
            recomputed_logprobs(engine, ids, c.token_ids, 1.0), abs=1e-4
        )
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 8
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert any(c.finish_reason == "stop" for c in completions)  # the warm start learned <eos>


async def test_greedy_stops_at_eos_and_length_caps(engine: HFEngine) -> None:
    ids = prompt(engine, 12, 34)
    [greedy] = await engine.generate("g", ids, SamplingParams(temperature=0, max_tokens=8))
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == EOS
    assert greedy.text.isdigit()
    expected = recomputed_logprobs(engine, ids, greedy.token_ids, 0)
    assert greedy.logprobs == pytest.approx(expected, abs=1e-4)
    [short] = await engine.generate("s", ids, SamplingParams(temperature=0, max_tokens=1))
    assert short.finish_reason == "length" and short.token_ids == greedy.token_ids[:1]


async def test_concurrent_requests_batch_and_keep_their_own_answers(engine: HFEngine) -> None:
    pairs = [(10 + i, 20 + 3 * i) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    alone = [
        await engine.generate(f"x{i}", prompt(engine, *p), greedy) for i, p in enumerate(pairs)
    ]
    together = await asyncio.gather(
        *[engine.generate(f"y{i}", prompt(engine, *p), greedy) for i, p in enumerate(pairs)]
    )
    assert [c[0].token_ids for c in together] == [c[0].token_ids for c in alone]
    mixed = await asyncio.gather(
        engine.generate("m1", prompt(engine, 1, 2), SamplingParams(n=3, max_tokens=4)),
        engine.generate(
            "m2", prompt(engine, 3, 4), SamplingParams(n=2, temperature=0, max_tokens=2)
        ),
    )
    assert [len(c) for c in mixed] == [3, 2]
    assert all(len(c.token_ids) <= 2 for c in mixed[1])


async def test_seeded_requests_repeat(engine: HFEngine) -> None:
    ids = prompt(engine, 45, 38)
    params = SamplingParams(n=4, temperature=1.5, max_tokens=8, seed=1234)
    first, second = await asyncio.gather(
        engine.generate("s1", ids, params), engine.generate("s2", ids, params)
    )
    assert [c.token_ids for c in first] == [c.token_ids for c in second]


async def test_stop_string_cuts_text_and_tokens(engine: HFEngine) -> None:
    ids = prompt(engine, 12, 34)
    [full] = await engine.generate("f", ids, SamplingParams(temperature=0, max_tokens=8))
    stop = full.text[1:]  # the answer's digits after the first one
    [cut] = await engine.generate(
        "c", ids, SamplingParams(temperature=0, max_tokens=8, stop=[stop])
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:1]
    assert cut.token_ids == full.token_ids[: len(full.token_ids) - 1]  # through the stop's end
    assert len(cut.logprobs) == len(cut.token_ids)


async def test_logprobs_zero_returns_none(engine: HFEngine) -> None:
    [c] = await engine.generate("l", prompt(engine, 1, 1), SamplingParams(max_tokens=3, logprobs=0))
    assert c.token_ids and c.logprobs == []


async def test_load_weights_changes_outputs_and_restores(engine: HFEngine) -> None:
    ids, greedy = prompt(engine, 12, 34), SamplingParams(temperature=0, max_tokens=6)
    before = (await engine.generate("b", ids, greedy))[0].token_ids
    original = original_weights(engine)
    torch.manual_seed(0)
    await engine.load_weights({k: torch.randn_like(v) for k, v in original.items()})
    changed = (await engine.generate("c", ids, greedy))[0].token_ids
    await engine.load_weights(original)
    assert changed != before
    assert (await engine.generate("r", ids, greedy))[0].token_ids == before


@pytest.mark.parametrize("mutation", ["wrong_shape", "unknown_name", "missing_name", "int_dtype"])
async def test_bad_weights_are_refused_before_touching_the_model(
    engine: HFEngine, mutation: str
) -> None:
    original = original_weights(engine)
    update = {k: torch.zeros_like(v) for k, v in original.items()}  # would break the model
    name = "model.layers.0.mlp.down_proj.weight"
    if mutation == "wrong_shape":
        update[name] = torch.zeros(3, 3)
    elif mutation == "unknown_name":
        update["model.layers.99.mlp.down_proj.weight"] = torch.zeros(1)
    elif mutation == "missing_name":
        del update[name]
    else:
        update[name] = update[name].to(torch.int32)
    with pytest.raises(InvalidArgument):
        await engine.load_weights(update)
    after = engine.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in original.items())


async def test_abort_queued_and_running_requests(engine: HFEngine) -> None:
    ids = prompt(engine, 12, 34)
    queued = asyncio.create_task(engine.generate("q", ids, SamplingParams(n=2, max_tokens=8)))
    await asyncio.sleep(0)
    await engine.abort("q")
    assert [c.finish_reason for c in await queued] == ["abort", "abort"]

    original = original_weights(engine)
    torch.manual_seed(1)
    await engine.load_weights({k: torch.randn_like(v) for k, v in original.items()})
    try:  # random weights rarely emit <eos>, so the batch would run all 50 steps
        running = asyncio.create_task(
            engine.generate("r", ids, SamplingParams(n=64, temperature=0, max_tokens=50))
        )
        while not engine.has_started("r"):
            await asyncio.sleep(0.001)
        await engine.abort("r")  # at once: 50 steps of 64 rows outlast this, however fast
        completions = await running
    finally:
        await engine.load_weights(original)
    assert {c.finish_reason for c in completions} <= {"abort", "stop"}
    aborted = [c for c in completions if c.finish_reason == "abort"]
    assert aborted and all(len(c.token_ids) < 50 for c in aborted)
    assert all(len(c.logprobs) == len(c.token_ids) for c in completions)


async def test_check_prompt_refuses_unknown_ids_and_overlong_requests(engine: HFEngine) -> None:
    engine.check_prompt([1, 15], 8)
    with pytest.raises(InvalidArgument):
        engine.check_prompt([1, 16], 8)
    with pytest.raises(InvalidArgument):
        engine.check_prompt([1] * 60, 8)  # 68 > rollout.max_model_len 64


async def test_requests_with_other_budgets_share_a_call_and_stop_at_their_own(
    engine: HFEngine,
) -> None:
    """Continued requests (``update_policy: keep``) come back with reduced ``max_tokens``:
    they share a call with full-budget ones, each row cut at its own budget, as if alone."""
    ids = prompt(engine, 12, 34)
    [whole] = await engine.generate("b-alone", ids, SamplingParams(temperature=0, max_tokens=8))
    before = engine.batches
    budgets = (1, 2, 8)
    answers = await asyncio.gather(
        *[
            engine.generate(f"b{m}", ids, SamplingParams(temperature=0, max_tokens=m))
            for m in budgets
        ]
    )
    assert engine.batches - before == 1
    for m, [c] in zip(budgets, answers, strict=True):
        assert c.token_ids == whole.token_ids[:m] and len(c.logprobs) == len(c.token_ids)
        reason = "stop" if len(whole.token_ids) <= m else "length"
        assert c.finish_reason == reason
        assert c.logprobs == pytest.approx(whole.logprobs[:m], abs=1e-4)


@pytest.mark.parametrize("window_ms", [0.0, 20.0])
async def test_requests_of_one_tick_share_one_generate_call(
    engine: HFEngine, window_ms: float
) -> None:
    """A packed queue entry submits its whole share in one tick: one ``model.generate`` call,
    whatever the batching window; each request still gets its own n completions."""
    saved, engine.batch_wait_s = engine.batch_wait_s, window_ms / 1000
    params = SamplingParams(n=4, max_tokens=4)
    before = engine.batches
    try:
        answers = await asyncio.gather(
            *[
                engine.generate(f"tick{window_ms}-{i}", prompt(engine, i, 2 * i + 1), params)
                for i in range(8)
            ]
        )
    finally:
        engine.batch_wait_s = saved
    assert engine.batches - before == 1
    assert [len(a) for a in answers] == [4] * 8
    assert all(len(c.logprobs) == len(c.token_ids) >= 1 for a in answers for c in a)


async def test_the_shared_prompt_prefill_samples_what_the_full_prefill_does(engine: HFEngine):
    """n samples of two prompts of different lengths: the prompt cache computed once per
    distinct prompt gives the same tokens and logits as generate's own prefill of every row."""
    from rlfleet.rollout.engines.hf_batch import left_pad, shared_prompt_cache

    rows = [prompt(engine, 7, 5)] * 4 + [prompt(engine, 12, 34)] * 4
    ids, mask = left_pad(rows, 0)
    assert ids.shape[1] > min(map(len, rows))  # one prompt is left-padded

    def sample(cache):
        torch.manual_seed(11)
        with torch.no_grad():
            return engine.model.generate(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=6,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=0,
                eos_token_id=[EOS],
                output_logits=True,
                return_dict_in_generate=True,
            )

    with torch.no_grad():
        cache = shared_prompt_cache(engine.model, ids, mask)
    assert cache is not None and cache.get_seq_length() == ids.shape[1] - 1
    shared, full = sample(cache), sample(None)
    assert torch.equal(shared.sequences, full.sequences)
    for a, b in zip(shared.logits, full.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    distinct = torch.tensor([rows[0], rows[4][: len(rows[0])]])
    assert shared_prompt_cache(engine.model, distinct, torch.ones_like(distinct)) is None
    one_column = torch.tensor([[1], [1]])
    assert shared_prompt_cache(engine.model, one_column, torch.ones_like(one_column)) is None
