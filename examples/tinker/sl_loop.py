"""Supervised fine-tuning through the Tinker API, written the way the tinker-cookbook's
``recipes/sl_loop.py`` is written (SDK calls only, one flat loop), on the repository's
arithmetic data instead of a Hub dataset.

    rlfleet up --config configs/tinker.yaml          # prints the API's base URL
    python examples/tinker/sl_loop.py base_url=http://127.0.0.1:PORT max_steps=20

Settings are ``key=value`` arguments (the fields of ``Config``); ``base_url`` defaults to
``TINKER_BASE_URL``, the API key to ``TINKER_API_KEY`` (any ``tml-...`` string when the fleet
has no ``api_key``). Each step prints one JSON line of metrics (and appends it to
``log_path/metrics.jsonl``).
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
from tinker import types

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Config:
    base_url: str | None = None
    log_path: str = "/tmp/tinker-examples/sl-loop"
    model_name: str | None = None  # None: the first model the server lists
    data_path: str = str(ROOT / "data" / "arith" / "train.jsonl")
    batch_size: int = 128
    learning_rate: float = 2e-3
    lora_rank: int = 16
    max_steps: int | None = 20
    seed: int = 0


def parse_config(argv: list[str]) -> Config:
    config = Config()
    for arg in argv:
        key, _, value = arg.partition("=")
        kind = type(getattr(config, key)) if getattr(config, key) is not None else str
        setattr(config, key, None if value == "None" else kind(value) if kind is not str else value)
    return config


def load_rows(path: str) -> list[tuple[str, str]]:
    """(question, answer) pairs of a verl-schema JSONL file."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(r["prompt"][-1]["content"], r["reward_model"]["ground_truth"]) for r in rows]


def to_datum(question: str, answer: str, tokenizer) -> types.Datum:
    """Train on the answer and the end of sequence only (weights 0 on the prompt)."""
    prompt = tokenizer.encode(question)
    completion = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt + completion
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def compute_mean_nll(logprobs: list, weights: list) -> float:
    total = sum(
        float(-(lp.to_numpy() * w.to_numpy()).sum())
        for lp, w in zip(logprobs, weights, strict=True)
    )
    return total / max(sum(float(w.to_numpy().sum()) for w in weights), 1e-9)


def log_metrics(config: Config, metrics: dict) -> None:
    line = json.dumps(metrics)
    print(line, flush=True)
    Path(config.log_path).mkdir(parents=True, exist_ok=True)
    with open(Path(config.log_path) / "metrics.jsonl", "a") as f:
        f.write(line + "\n")


def main(config: Config) -> None:
    service_client = tinker.ServiceClient(base_url=config.base_url)
    rest_client = tinker.RestClient(base_url=config.base_url)
    capabilities = rest_client.get_server_capabilities().result()
    model_name = config.model_name or capabilities.supported_models[0].model_name
    training_client = service_client.create_lora_training_client(
        base_model=model_name, rank=config.lora_rank, train_unembed=False
    ).result()
    tokenizer = training_client.get_tokenizer()

    rows = load_rows(config.data_path)
    random.Random(config.seed).shuffle(rows)
    n_train_batches = len(rows) // config.batch_size
    total_steps = (
        n_train_batches if config.max_steps is None else min(n_train_batches, config.max_steps)
    )

    for step in range(total_steps):
        start_time = time.time()
        lr_mult = max(0.0, 1.0 - step / total_steps)
        current_lr = config.learning_rate * lr_mult
        adam_params = tinker.AdamParams(learning_rate=current_lr, beta1=0.9, beta2=0.95, eps=1e-8)
        batch_rows = rows[step * config.batch_size : (step + 1) * config.batch_size]
        batch = [to_datum(q, a, tokenizer) for q, a in batch_rows]

        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_step_future = training_client.optim_step(adam_params)
        fwd_bwd_result = fwd_bwd_future.result()
        optim_result = optim_step_future.result()

        train_logprobs = [x["logprobs"] for x in fwd_bwd_result.loss_fn_outputs]
        train_weights = [d.loss_fn_inputs["weights"] for d in batch]
        metrics = {
            "step": step,
            "num_sequences": len(batch),
            "num_tokens": sum(d.model_input.length for d in batch),
            "learning_rate": current_lr,
            "train_mean_nll": compute_mean_nll(train_logprobs, train_weights),
            "time_total": time.time() - start_time,
            **(optim_result.metrics or {}),
        }
        log_metrics(config, metrics)

    final = training_client.save_state("final").result()
    print(f"saved training state: {final.path}", flush=True)
    service_client.close("success").result()


if __name__ == "__main__":
    cfg = parse_config(sys.argv[1:])
    cfg.base_url = cfg.base_url or os.environ.get("TINKER_BASE_URL")
    main(cfg)
