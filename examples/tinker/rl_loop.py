"""Reinforcement learning through the Tinker API, written the way the tinker-cookbook's
``recipes/rl_loop.py`` is written (SDK calls only, GRPO-style reward centering), on the
repository's arithmetic data instead of GSM8K.

    rlfleet up --config configs/tinker.yaml
    python examples/tinker/rl_loop.py base_url=http://127.0.0.1:PORT max_steps=10

Each step: save the adapter and get a sampling client (the fleet's replicas sample from it),
draw ``group_size`` answers per question, reward 1 for the right sum, center the rewards within
each group, and take one ``forward_backward`` (``importance_sampling``, ``ppo`` or ``cispo``)
and ``optim_step``. Settings are ``key=value`` arguments (the fields of ``Config``); each step
prints one JSON line of metrics. Before the first step and after the last, the held-out split
(``eval_path``, the first ``eval_size`` questions) is answered greedily through a sampling
client of the adapter as it is then, and its accuracy printed as a JSON line
(``{"eval": "before"|"after", "heldout_accuracy": ...}``).

Variable naming follows the cookbook: _P problems, _G group members, _T tokens, _D datums.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import tinker
import torch
from tinker import types
from tinker.types.tensor_data import TensorData

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Config:
    base_url: str | None = None
    log_path: str = "/tmp/tinker-examples/rl-loop"
    model_name: str | None = None  # None: the first model the server lists
    data_path: str = str(ROOT / "data" / "arith" / "train.jsonl")
    eval_path: str = str(ROOT / "data" / "arith" / "test.jsonl")
    eval_size: int = 128  # held-out questions answered before and after training (0: none)
    batch_size: int = 16
    group_size: int = 8
    learning_rate: float = 3e-4
    lora_rank: int = 16
    max_tokens: int = 6
    loss_fn: str = "importance_sampling"  # or "ppo", "cispo"
    max_steps: int | None = 10
    seed: int = 0


def parse_config(argv: list[str]) -> Config:
    config = Config()
    for arg in argv:
        key, _, value = arg.partition("=")
        kind = type(getattr(config, key)) if getattr(config, key) is not None else str
        setattr(config, key, None if value == "None" else kind(value) if kind is not str else value)
    return config


def load_rows(path: str) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(r["prompt"][-1]["content"], r["reward_model"]["ground_truth"]) for r in rows]


def get_reward(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer else 0.0


def evaluate(sampling_client, tokenizer, rows: list[tuple[str, str]], max_tokens: int) -> float:
    """Accuracy of greedy answers to ``rows``, all sampled at once."""
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [
        sampling_client.sample(
            prompt=types.ModelInput.from_ints(tokenizer.encode(question)),
            num_samples=1,
            sampling_params=greedy,
        )
        for question, _ in rows
    ]
    correct = [
        get_reward(tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True), a)
        for f, (_, a) in zip(futures, rows, strict=True)
    ]
    return sum(correct) / len(correct)


def report_eval(when: str, training_client, tokenizer, rows, config: Config) -> None:
    if not rows:
        return
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    accuracy = evaluate(sampling_client, tokenizer, rows, config.max_tokens)
    print(json.dumps({"eval": when, "heldout_accuracy": accuracy, "n": len(rows)}), flush=True)


def main(config: Config) -> None:
    service_client = tinker.ServiceClient(base_url=config.base_url)
    rest_client = tinker.RestClient(base_url=config.base_url)
    model_name = (
        config.model_name
        or rest_client.get_server_capabilities().result().supported_models[0].model_name
    )
    training_client = service_client.create_lora_training_client(
        base_model=model_name, rank=config.lora_rank, train_unembed=False
    ).result()
    tokenizer = training_client.get_tokenizer()
    rows = load_rows(config.data_path)
    random.Random(config.seed).shuffle(rows)
    heldout = load_rows(config.eval_path)[: config.eval_size]
    report_eval("before", training_client, tokenizer, heldout, config)
    n_train_batches = len(rows) // config.batch_size
    sampling_params = types.SamplingParams(max_tokens=config.max_tokens, temperature=1.0)
    adam_params = types.AdamParams(
        learning_rate=config.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8
    )
    total_steps = (
        n_train_batches if config.max_steps is None else min(n_train_batches, config.max_steps)
    )

    for batch_idx in range(total_steps):
        t_start = time.time()
        metrics: dict[str, float] = {"step": batch_idx, "optim/lr": config.learning_rate}
        batch_rows = rows[batch_idx * config.batch_size : (batch_idx + 1) * config.batch_size]
        sampling_client = training_client.save_weights_and_get_sampling_client().result()

        futures_P, prompts_P = [], []
        for question, _ in batch_rows:
            model_input = types.ModelInput.from_ints(tokenizer.encode(question))
            futures_P.append(
                sampling_client.sample(
                    prompt=model_input,
                    num_samples=config.group_size,
                    sampling_params=sampling_params,
                )
            )
            prompts_P.append(model_input)

        datums_D: list[types.Datum] = []
        rewards_P: list[float] = []
        for future, prompt, (_, answer) in zip(futures_P, prompts_P, batch_rows, strict=True):
            sample_result = future.result()
            rewards_G, tokens_G_T, logprobs_G_T = [], [], []
            for sequence in sample_result.sequences:
                tokens_G_T.append(sequence.tokens)
                logprobs_G_T.append(sequence.logprobs)
                text = tokenizer.decode(sequence.tokens, skip_special_tokens=True)
                rewards_G.append(get_reward(text, answer))
            mean_reward = sum(rewards_G) / len(rewards_G)
            advantages_G = [reward - mean_reward for reward in rewards_G]
            rewards_P.append(mean_reward)
            if all(advantage == 0.0 for advantage in advantages_G):
                continue
            for sampled_tokens, logprobs, advantage in zip(
                tokens_G_T, logprobs_G_T, advantages_G, strict=True
            ):
                ob_len = prompt.length - 1
                model_input = prompt.append(types.EncodedTextChunk(tokens=sampled_tokens[:-1]))
                target_tokens = [0] * ob_len + sampled_tokens
                padded_logprobs = [0.0] * ob_len + logprobs
                padded_advantages = [0.0] * ob_len + [advantage] * (model_input.length - ob_len)
                datums_D.append(
                    types.Datum(
                        model_input=model_input,
                        loss_fn_inputs={
                            "target_tokens": TensorData.from_torch(torch.tensor(target_tokens)),
                            "logprobs": TensorData.from_torch(torch.tensor(padded_logprobs)),
                            "advantages": TensorData.from_torch(torch.tensor(padded_advantages)),
                        },
                    )
                )

        if datums_D:
            fwd_bwd_future = training_client.forward_backward(datums_D, loss_fn=config.loss_fn)
            optim_step_future = training_client.optim_step(adam_params)
            fwd_bwd_future.result()
            optim_result = optim_step_future.result()
            metrics.update(optim_result.metrics or {})
        metrics["num_datums"] = len(datums_D)
        metrics["time/total"] = time.time() - t_start
        metrics["reward/total"] = sum(rewards_P) / len(rewards_P)
        print(json.dumps(metrics), flush=True)

    report_eval("after", training_client, tokenizer, heldout, config)
    service_client.close("success").result()


if __name__ == "__main__":
    cfg = parse_config(sys.argv[1:])
    cfg.base_url = cfg.base_url or os.environ.get("TINKER_BASE_URL")
    main(cfg)
