"""The transformers backend takes each token's log-prob as ``generate`` goes, not from
``output_logits``: the values are the ones ``output_logits`` gives, and no step's
full-vocabulary logits outlive the step.

How the old values are had: a spy wraps the model's ``generate``, asks the very call the engine
makes for ``output_logits`` as well (no random numbers involved, so the same tokens come out)
and computes ``log_softmax(logits / T)`` at each row's new tokens from them, as the engine did.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from transformers import StoppingCriteria

from rlfleet.common.config import load_config
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.types import Completion, SamplingParams

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


class Spy:
    """Stands in for ``engine.model.generate``: records each call's arguments; with
    ``old_method`` it also asks for ``output_logits`` and keeps the log-probs the engine used
    to compute from them (``[rows, new tokens]``), with the call's new tokens."""

    def __init__(self, model: Any, old_method: bool, extra_criteria: list | None = None) -> None:
        self.real = type(model).generate.__get__(model)  # the model's own, not another spy
        self.old_method = old_method
        self.extra_criteria = extra_criteria or []
        self.calls: list[dict] = []
        self.old: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, **kwargs: Any) -> Any:
        self.calls.append(dict(kwargs))
        kwargs["stopping_criteria"] = type(kwargs["stopping_criteria"])(
            [*kwargs["stopping_criteria"], *self.extra_criteria]
        )
        if not self.old_method:
            return self.real(**kwargs)
        kwargs.update(output_logits=True, return_dict_in_generate=True)
        out = self.real(**kwargs)
        new = out.sequences[:, kwargs["input_ids"].shape[1] :]
        scale = kwargs.get("temperature") or 1.0  # None for greedy
        logp = torch.log_softmax(torch.stack(out.logits, dim=1).float() / scale, dim=-1)
        self.old.append((new, logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)))
        return out.sequences


@pytest.fixture
def spy(engine: HFEngine, monkeypatch: pytest.MonkeyPatch):
    def install(old_method: bool = True, extra_criteria: list | None = None) -> Spy:
        made = Spy(engine.model, old_method, extra_criteria)
        monkeypatch.setattr(engine.model, "generate", made)
        return made

    return install


def prompt(engine: HFEngine, a: int, b: int) -> list[int]:
    return engine.encode(f"{a}+{b}=")


def assert_old_values(spy: Spy, answers: list[list[Completion]]) -> int:
    """Every completion (rows in request order, ``n`` each, one call) has the old method's
    log-probs to 1e-6; returns how many rows ended before the call's last step."""
    assert len(spy.old) == 1
    new, old = spy.old[0]
    rows = [c for answer in answers for c in answer]
    assert len(rows) == new.shape[0]
    early = 0
    for row, c in enumerate(rows):
        width = len(c.token_ids)
        assert c.token_ids == new[row, :width].tolist()
        assert len(c.logprobs) == width
        assert c.logprobs == pytest.approx(old[row, :width].tolist(), abs=1e-6, rel=0)
        early += width < new.shape[1]
    return early


CASES = {
    "sampled-n8": SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=7),
    "warped-n4": SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=5, max_tokens=8, seed=3),
    "hot-n6": SamplingParams(n=6, temperature=2.5, max_tokens=10, seed=5),
    "greedy-n3": SamplingParams(n=3, temperature=0, max_tokens=8),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_one_request_gets_the_output_logits_values(engine: HFEngine, spy, case) -> None:
    """n rows sharing the prompt cache, early EOS (padding after it) in some rows."""
    made = spy()
    answers = [await engine.generate(case, prompt(engine, 12, 34), CASES[case])]
    early = assert_old_values(made, answers)
    if case in ("sampled-n8", "hot-n6"):  # rows that end at different steps (seeded)
        assert early >= 1 and any(c.finish_reason == "stop" for c in answers[0])


async def test_a_shared_call_gets_the_output_logits_values(engine: HFEngine, spy) -> None:
    """Unseeded requests of one tick: prompts of other widths (left padding), other budgets
    and n, greedy and sampled in separate calls."""
    for sampling in (dict(temperature=1.0), dict(temperature=0)):
        made = spy()
        answers = await asyncio.gather(
            *[
                engine.generate(
                    f"shared-{sampling['temperature']}-{i}",
                    prompt(engine, a, b),
                    SamplingParams(n=n, max_tokens=m, **sampling),
                )
                for i, (a, b, n, m) in enumerate([(1, 1, 2, 8), (12, 34, 3, 3), (45, 38, 1, 8)])
            ]
        )
        early = assert_old_values(made, list(answers))
        assert early >= 1  # "1+1=" ends first, and the max_tokens=3 rows stop at 3


class AbortAt(StoppingCriteria):
    """Aborts a request through the engine's API once ``step`` new tokens are in."""

    def __init__(self, engine: HFEngine, request_id: str, prompt_width: int, step: int) -> None:
        self.engine, self.request_id, self.width, self.step = engine, request_id, prompt_width, step
        self.loop = asyncio.get_running_loop()

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if input_ids.shape[1] - self.width == self.step:
            abort = self.engine.abort(self.request_id)
            asyncio.run_coroutine_threadsafe(abort, self.loop).result(timeout=10)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


async def test_aborted_rows_get_the_output_logits_values(engine: HFEngine, spy) -> None:
    ids = prompt(engine, 123, 456)
    made = spy(extra_criteria=[AbortAt(engine, "ab", len(ids), step=2)])
    params = SamplingParams(n=4, temperature=1.5, max_tokens=8, seed=11)
    answers = [await engine.generate("ab", ids, params)]
    assert_old_values(made, answers)
    assert any(c.finish_reason == "abort" and len(c.token_ids) == 3 for c in answers[0])


async def test_a_merged_lora_adapter_gets_the_output_logits_values(engine: HFEngine, spy):
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    name = "model.layers.0.self_attn.q_proj.weight"
    out_features, in_features = original[name].shape
    torch.manual_seed(0)
    adapter = {
        f"lora::{name}::A": torch.randn(4, in_features) * 0.3,
        f"lora::{name}::B": torch.randn(out_features, 4) * 0.3,
    }
    await engine.load_weights(adapter)
    try:
        assert engine.adapter_merged
        made = spy()
        params = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=2)
        assert_old_values(made, [await engine.generate("lora", prompt(engine, 7, 8), params)])
    finally:
        await engine.load_weights(original)


class CountLogitsAlive(StoppingCriteria):
    """After each step (the engine's criteria have run), how many ``[rows, vocab]`` float
    tensors are alive: what retained logits would pile up as."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape, self.counts = torch.Size(shape), []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        alive = [o for o in gc.get_objects() if type(o) is torch.Tensor]
        self.counts.append(sum(t.shape == self.shape and t.is_floating_point() for t in alive))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


async def test_no_step_keeps_its_logits(engine: HFEngine, spy) -> None:
    """generate is not asked for logits or scores, and the number of live full-vocabulary
    tensors stays flat over the steps (kept logits would add one per step)."""
    rows, vocab = 7, engine.model.config.vocab_size  # 7 x 16: no weight has this shape
    counter = CountLogitsAlive((rows, vocab))
    made = spy(old_method=False, extra_criteria=[counter])
    params = SamplingParams(n=rows, temperature=5.0, max_tokens=10, seed=1)
    [answer] = [await engine.generate("mem", prompt(engine, 12, 34), params)]
    [call] = made.calls
    assert not call.get("output_logits") and not call.get("output_scores")
    assert not call.get("return_dict_in_generate")
    assert len(counter.counts) >= 6  # near-uniform sampling: some row runs long
    assert max(counter.counts) <= counter.counts[0] <= 3  # logits, scores, probs of a step
    assert all(len(c.logprobs) == len(c.token_ids) for c in answer)
