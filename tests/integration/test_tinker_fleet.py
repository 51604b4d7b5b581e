"""The Tinker API over a real fleet, driven by the official ``tinker`` SDK (the ``tinker`` extra).

One ``rlfleet up --config configs/tinker.yaml`` (tiny policy, one HF replica, an API key) for
the module: the cookbook-style examples run unchanged against it (``sl_loop`` learns: its
loss falls); two training clients train at once and each adapter moves only under its own
client; a sample is drawn from the adapter's own weights (the replica's log-probs equal the
trainer's for the same tokens); unsupported calls and bad input are refused by name.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tinker
from procs import ROOT
from tinker import types
from tinker_proc import (
    KEY,
    adapter,
    assert_trainer_agrees,
    base_model,
    run_example,
    sft_batch,
    tinker_fleet,
    train,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tinker")
    run_dir = tmp / "run"
    with tinker_fleet(run_dir, tmp / "up.log", "tinkertest") as (url, _):
        yield url, run_dir


@pytest.fixture(scope="module")
def service(fleet):
    client = tinker.ServiceClient(base_url=fleet[0], api_key=KEY)
    yield client
    client.close("success").result()


def test_endpoints_name_the_api_and_the_key_guards_it(fleet) -> None:
    url, run_dir = fleet
    assert json.loads((run_dir / "endpoints.json").read_text())["tinker"] == {"http": url}
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=url, api_key="tml-wrong").get_server_capabilities().result()


def test_sl_loop_example_learns(fleet, tmp_path) -> None:
    rows = run_example("sl_loop.py", fleet[0], "max_steps=20", f"log_path={tmp_path}")
    nll = [row["train_mean_nll"] for row in rows]
    assert len(nll) == 20
    first, last = np.mean(nll[:5]), np.mean(nll[-5:])
    assert last < 0.9 * first, nll


def test_rl_loop_example_runs_its_steps(fleet) -> None:
    lines = run_example("rl_loop.py", fleet[0], "max_steps=3", "loss_fn=ppo", "eval_size=8")
    evals = [line for line in lines if "eval" in line]
    assert [(e["eval"], e["n"]) for e in evals] == [("before", 8), ("after", 8)]
    assert all(0.0 <= e["heldout_accuracy"] <= 1.0 for e in evals)
    rows = [line for line in lines if "step" in line]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert any(row["num_datums"] > 0 for row in rows)
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rows)


def moved(before: dict, after: dict) -> bool:
    return any(not np.array_equal(before[k], after[k]) for k in before)


def test_two_adapters_train_apart(fleet, service) -> None:
    url, run_dir = fleet
    model = base_model(url)
    a = service.create_lora_training_client(base_model=model, rank=8, train_unembed=False).result()
    b = service.create_lora_training_client(
        base_model=model, rank=4, train_mlp=False, train_unembed=False
    ).result()
    tokenizer = a.get_tokenizer()
    for client, name in ((a, "s0"), (b, "s0")):
        client.save_state(name).result()
    train(a, tokenizer, 2)
    a.save_state("s1").result(), b.save_state("s1").result()
    assert moved(adapter(run_dir, a.model_id, "s0"), adapter(run_dir, a.model_id, "s1"))
    assert not moved(adapter(run_dir, b.model_id, "s0"), adapter(run_dir, b.model_id, "s1"))
    train(b, tokenizer, 2)
    a.save_state("s2").result(), b.save_state("s2").result()
    assert not moved(adapter(run_dir, a.model_id, "s1"), adapter(run_dir, a.model_id, "s2"))
    assert moved(adapter(run_dir, b.model_id, "s1"), adapter(run_dir, b.model_id, "s2"))
    # both sample at once: each sample runs on its own adapter's weights
    samplers = [c.save_weights_and_get_sampling_client().result() for c in (a, b)]
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34="))
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    futures = [s.sample(prompt, 4, params) for s in samplers for _ in range(2)]
    for client, future in zip((a, a, b, b), futures, strict=True):
        for sequence in future.result().sequences:
            assert_trainer_agrees(client, prompt.to_ints(), sequence)


@pytest.mark.parametrize(
    ("what", "call", "named"),
    [
        ("unknown loss", lambda c, t: c.forward_backward(sft_batch(t, 2), "dro"), "'dro'"),
        (
            "wrong shape",
            lambda c, t: c.forward_backward(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([1, 5, 6]),
                        loss_fn_inputs={"target_tokens": [5, 6, 7], "weights": [1.0, 1.0]},
                    )
                ],
                "cross_entropy",
            ),
            "shape [2], expected [3]",
        ),
        (
            "too long",
            lambda c, t: c.forward_backward(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints([5] * 40),
                        loss_fn_inputs={"target_tokens": [5] * 40, "weights": [1.0] * 40},
                    )
                ],
                "cross_entropy",
            ),
            "1 to 32",
        ),
        ("missing input", lambda c, t: c.forward_backward(sft_batch(t, 2), "ppo"), "missing"),
        (
            "prompt logprobs",
            lambda c, t: (
                c.save_weights_and_get_sampling_client()
                .result()
                .sample(
                    types.ModelInput.from_ints([1, 5]),
                    1,
                    types.SamplingParams(max_tokens=2),
                    include_prompt_logprobs=True,
                )
            ),
            "include_prompt_logprobs",
        ),
    ],
)
def test_bad_calls_are_refused_by_name(fleet, service, what, call, named) -> None:
    client = service.create_lora_training_client(
        base_model=base_model(fleet[0]), rank=2, train_unembed=False
    ).result()
    with pytest.raises(Exception, match=named.replace("[", r"\[").replace("]", r"\]")):
        call(client, client.get_tokenizer()).result()


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({}, "train_unembed"),
        ({"rank": 64, "train_unembed": False}, "rank 64"),
        ({"base_model": "Qwen/Qwen3-8B", "train_unembed": False}, "Qwen/Qwen3-8B"),
    ],
)
def test_unsupported_training_clients_are_refused_by_name(fleet, service, kwargs, named) -> None:
    args = {"base_model": base_model(fleet[0]), "rank": 8, **kwargs}
    with pytest.raises(Exception, match=named):
        service.create_lora_training_client(**args).result()


def test_get_tokenizer_is_the_fleets_own_offline(fleet, service) -> None:
    from rlfleet.model.model_io import load_tokenizer

    client = service.create_lora_training_client(
        base_model=base_model(fleet[0]), rank=2, train_unembed=False
    ).result()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ours = load_tokenizer(ROOT / "models" / "tiny-qwen2-arith")
    theirs = client.get_tokenizer()
    for text in ("12+34=46", "7+8=", "1 2"):
        assert theirs.encode(text) == ours.encode(text)
