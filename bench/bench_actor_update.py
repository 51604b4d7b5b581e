"""The actor's update on one batch: one forward per row against one forward per distinct prompt,
with transformers' ``sdpa`` and ``eager`` attention.

Why: with KL off, the actor's update is most of an asynchronous step on this machine
(bench/results/e2e.md). A GRPO batch repeats each prompt ``n`` times; running each distinct
prompt once and the responses on top of its KV cache (``trainer.share_prompt_forward``) sends
fewer tokens through forward and backward for the same gradient. Which attention kernel is
faster for sequences of ~15 tokens on CPU is the other knob (``model.attn_implementation``).

Variants (all in one run, rounds interleaved in ABBA order), each its own ``Actor`` on its own
copy of the tiny policy, built from configs/default.yaml:

- ``rows/sdpa`` (the configuration before this benchmark), ``shared/sdpa``, ``rows/eager``,
  ``shared/eager``.

Work: one ``Actor.update`` on a batch sampled from the tiny policy (temperature 0.7, up to 8
new tokens, ``n=8``): 16 prompts (the default job: two mini-batches of 64) and 32 prompts
(the e2e benchmark's equal-work step); advantages drawn from N(0, 1) per row, so no row is
skipped as zero-advantage. Also the no-grad forward (``Actor.logprobs``, the path of the
reference's log-probs) on the 32-prompt batch.

Usage: ``python bench/bench_actor_update.py [--quick]`` (or ``run_all.py --only
actor_update``); writes ``bench/results/actor_update.json`` and ``.md``.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

from common import MODEL_DIR, REPO, BenchResult, Options, Stats, abba, progress, ratio

NAME = "actor_update"
TITLE = "Actor update: one forward per row vs one per distinct prompt, sdpa vs eager"
VARIANTS = ["rows/sdpa", "shared/sdpa", "rows/eager", "shared/eager"]
SHAPES = {"16x8": 16, "32x8": 32}
N_SAMPLES, MAX_TOKENS, TEMPERATURE = 8, 8, 0.7
THREADS = 2


def run(options: Options) -> BenchResult:
    import torch

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    actors = {variant: _actor(variant) for variant in VARIANTS}
    batches = {shape: _batch(actors["rows/sdpa"], prompts) for shape, prompts in SHAPES.items()}
    work = [(f"update {shape}", shape) for shape in SHAPES] + [("logprobs 32x8", "32x8")]
    rounds = options.pick(12, 3)
    samples: dict[tuple[str, str], list[float]] = {}
    for label, shape in work:
        for variant in VARIANTS:  # warm-up: allocator, lazy inits
            _time(actors[variant], label, batches[shape])
        for index, variant in abba(VARIANTS, rounds):
            if index % 8 == 0:
                progress(f"{NAME}: {label} round {index // len(VARIANTS) + 1}/{rounds}")
            seconds = _time(actors[variant], label, batches[shape])
            samples.setdefault((label, variant), []).append(seconds)
    return _result(samples, batches, options)


def _actor(variant: str) -> Any:
    from rlfleet.common.config import load_config
    from rlfleet.model.model_io import load_causal_lm
    from rlfleet.trainer.actor import Actor

    forward, attn = variant.split("/")
    config = load_config(
        REPO / "configs" / "default.yaml",
        overrides=[
            f"model.path={MODEL_DIR}",
            f"model.attn_implementation={attn}",
            f"trainer.share_prompt_forward={forward == 'shared'}",
        ],
        env={},
    )
    model = load_causal_lm(MODEL_DIR, "float32", attn)
    return Actor(config, copy.deepcopy(model), pad_id=0)


def _batch(actor: Any, prompts: int) -> dict[str, Any]:
    """``prompts`` training prompts x ``N_SAMPLES`` responses sampled from the policy."""
    import json

    import torch

    from rlfleet.model.model_io import load_tokenizer
    from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask

    tokenizer = load_tokenizer(MODEL_DIR)
    lines = (REPO / "data" / "arith" / "train.jsonl").read_text().splitlines()[:prompts]
    texts = [json.loads(line)["prompt"][0]["content"] for line in lines]
    batch = RolloutBatch()
    for text in texts:
        ids = [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
        with torch.no_grad():
            out = actor.model.generate(
                torch.tensor([ids] * N_SAMPLES),
                do_sample=True,
                temperature=TEMPERATURE,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=0,
                eos_token_id=tokenizer.eos_token_id,
            )
        for row in out[:, len(ids) :].tolist():
            eos = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else None
            batch.prompts.append(ids)
            batch.responses.append(row[:eos])
    batch.behaviour_logprobs = actor.logprobs(batch.prompts, batch.responses)
    mask = response_mask(batch.response_lengths())
    advantages = torch.randn(len(batch), 1) * mask
    return {"batch": batch, "mask": mask, "advantages": advantages}


def _time(actor: Any, label: str, work: dict[str, Any]) -> float:
    batch = work["batch"]
    start = time.perf_counter()
    if label.startswith("update"):
        actor.update(batch, work["advantages"], work["mask"])
    else:
        actor.logprobs(batch.prompts, batch.responses)
    return time.perf_counter() - start


def _result(samples, batches, options: Options) -> BenchResult:
    rows = []
    p50 = {}
    for (label, variant), seconds in samples.items():
        stats = Stats.of(seconds)
        p50[(label, variant)] = stats.p50
        rows.append(
            {
                "work": label,
                "variant": variant,
                "n": stats.n,
                "p50_ms": stats.p50 * 1e3,
                "p90_ms": stats.p90 * 1e3,
            }
        )
    for row in rows:
        row["x_rows_sdpa"] = ratio(row["p50_ms"], p50[(row["work"], "rows/sdpa")] * 1e3)
    ratios = {}
    for label in dict.fromkeys(label for label, _ in samples):
        base = p50[(label, "rows/sdpa")]
        ratios[f"{label}: shared/eager / rows/sdpa"] = ratio(p50[(label, "shared/eager")], base)
        ratios[f"{label}: shared/sdpa / rows/sdpa"] = ratio(p50[(label, "shared/sdpa")], base)
        ratios[f"{label}: rows/eager / rows/sdpa"] = ratio(p50[(label, "rows/eager")], base)
    shapes = {
        shape: {
            "rows": len(work["batch"]),
            "mean_response_tokens": float(work["mask"].sum() / len(work["batch"])),
            "prompt_tokens": sum(map(len, work["batch"].prompts)) / len(work["batch"]),
        }
        for shape, work in batches.items()
    }
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios,
        notes=NOTES,
        columns=["work", "variant", "n", "p50_ms", "p90_ms", "x_rows_sdpa"],
        params={
            "torch_threads": THREADS,
            "mini_batch": 64,
            "shapes": shapes,
            "quick": options.quick,
        },
    )


NOTES = [
    "rows = one forward over every (prompt, response) row (trainer.share_prompt_forward=false); "
    "shared = each distinct prompt once, responses on its KV cache (the default since this "
    "benchmark); both give the same gradient (tests/unit/test_shared_prompts.py).",
    "sdpa / eager = model.attn_implementation (transformers' default is sdpa).",
    "update = Actor.update: PPO loss, backward and AdamW step per mini-batch of 64 rows "
    "(configs/default.yaml); logprobs = Actor.logprobs, a no-grad forward over 256 rows.",
    "Single process, 2 torch threads, nothing else running from this benchmark.",
    "Mini-batches are drawn from a shuffled batch: 64 rows of 16 prompts x 8 hold all 16 "
    "prompts (4 rows each), 64 rows of 32 x 8 about 29 (2.2 rows each), so sharing saves "
    "less at 32x8.",
]


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
