"""The trainer's peak memory in the actor update of the SmolLM2 recipe, and what each lever
costs in time: glibc's mmap threshold, gradient checkpointing, smaller micro-batches.

Why: the issue's target is no role above 4 GB peak RSS, and the trainer of
configs/grpo_smollm2_math.yaml peaked at 7-8 GB in a real run (full fine-tuning of 135M
parameters in fp32 holds 2.2 GB of weights, gradients and Adam moments before any activation).

Each variant runs in a process of its own (a peak is per process), built from the recipe's
config (SmolLM2-135M-Instruct fp32, micro-batches of 8) plus its overrides and environment:

- ``default``: glibc's malloc as it comes.
- ``lean-malloc``: ``MALLOC_MMAP_THRESHOLD_=1048576`` (what ``rlfleet up`` gives every role).
- ``lean-malloc+ckpt``: and ``model.enable_gradient_checkpointing=true``.
- ``lean-malloc+micro4``: and ``trainer.ppo_micro_batch_size=4``.
- ``lean-malloc+lora32``: and a LoRA adapter of rank 32 on every linear layer
  (``model.lora_rank=32``, alpha 64) instead of full fine-tuning: no gradients or Adam moments
  for the 135M base weights, and no weight gradients in its backward.
- ``lean-malloc+fp32``: and no bf16 autocast (the recipe's ``auto`` takes bf16 where the CPU
  has AMX or AVX-512 BF16; this shows what that choice is worth on the machine at hand).

Work: ``STEPS`` updates of the recipe's step (8 prompts x 8 samples), the same seeded batch
shapes in every process: prompts of 40-80 tokens, response lengths drawn around the recipe's
measured mean (~35 tokens), up to 128; advantages from N(0, 1). Update time is the mean of
the steps after the first (the first also creates Adam's moments). Rounds run in ABBA order.

Usage: ``python bench/bench_trainer_memory.py [--quick]`` (or ``run_all.py --only
trainer_memory``); needs ``make smollm2``. Writes bench/results/trainer_memory.{json,md}.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import REPO, BenchResult, Options, abba, progress, ratio

NAME = "trainer_memory"
TITLE = "Trainer peak memory of the SmolLM2 recipe's update: malloc, checkpointing, micro-batches"
CONFIG = REPO / "configs" / "grpo_smollm2_math.yaml"
LEAN = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "default": ({}, []),
    "lean-malloc": (LEAN, []),
    "lean-malloc+ckpt": (LEAN, ["model.enable_gradient_checkpointing=true"]),
    "lean-malloc+micro4": (LEAN, ["trainer.ppo_micro_batch_size=4"]),
    "lean-malloc+lora32": (LEAN, ["model.lora_rank=32", "model.lora_alpha=64"]),
    "lean-malloc+fp32": (LEAN, ["trainer.autocast_dtype=none"]),
}
GROUPS, GROUP_SIZE, MAX_RESPONSE, MEAN_RESPONSE = 8, 8, 128, 35


def run(options: Options) -> BenchResult:
    steps, rounds = options.pick(3, 2), options.pick(2, 1)
    records: dict[str, list[dict[str, Any]]] = {}
    started = time.monotonic()
    for index, variant in abba(list(VARIANTS), rounds):
        progress(f"{NAME}: round {index + 1}/{rounds}, {variant}")
        records.setdefault(variant, []).append(_child(variant, steps))
    return _result(records, steps, rounds, time.monotonic() - started)


def _child(variant: str, steps: int) -> dict[str, Any]:
    """One variant's process; its JSON line."""
    env_extra, _ = VARIANTS[variant]
    env = {k: v for k, v in os.environ.items() if k not in LEAN}  # default: glibc's own
    env.update(env_extra)
    argv = [sys.executable, __file__, "--child", variant, str(steps)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{variant} exited {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _result(records, steps: int, rounds: int, seconds: float) -> BenchResult:
    rows = []
    for variant, runs in records.items():
        updates = [s for r in runs for s in r["step_s"][1:]]
        rows.append(
            {
                "variant": variant,
                "peak_rss_GB": max(r["peak_GB"] for r in runs),
                "rss_after_step_GB": max(r["rss_after_GB"] for r in runs),
                "update_s": sum(updates) / len(updates),
                "first_step_peak_GB": max(r["first_peak_GB"] for r in runs),
            }
        )
    base = next(r for r in rows if r["variant"] == "default")
    ratios = {}
    for row in rows[1:]:
        ratios[f"{row['variant']} / default peak RSS"] = ratio(
            row["peak_rss_GB"], base["peak_rss_GB"]
        )
        ratios[f"{row['variant']} / default update s"] = ratio(row["update_s"], base["update_s"])
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=["variant", "peak_rss_GB", "first_step_peak_GB", "rss_after_step_GB", "update_s"],
        rows=rows,
        ratios=ratios,
        seconds=seconds,
        params={
            "config": CONFIG.relative_to(REPO),
            "steps": steps,
            "rounds": rounds,
            "rows_per_step": GROUPS * GROUP_SIZE,
            "max_response_tokens": MAX_RESPONSE,
        },
        notes=[
            "peak_rss_GB: VmHWM of the variant's process over all its steps (the largest of its "
            "rounds); first_step_peak_GB: before Adam's moments exist; rss_after_step_GB: VmRSS "
            "once the last step returned",
            "the update alone: a real trainer also holds the async weight push (a snapshot of the "
            "weights and the shared-memory payload, 0.54 GB each in fp32)",
        ],
    )


def child(variant: str, steps: int) -> None:
    """Build the recipe's actor with ``variant``'s overrides and time ``steps`` updates."""
    from rlfleet.common.config import load_config
    from rlfleet.trainer.run import build_actor

    config = load_config(str(CONFIG), VARIANTS[variant][1], env=dict(os.environ))
    _, actor = build_actor(config)
    record: dict[str, Any] = {"variant": variant, "step_s": []}
    for step in range(steps):
        batch, advantages, mask = _batch(random.Random(step))
        started = time.perf_counter()
        actor.update(batch, advantages, mask)
        record["step_s"].append(time.perf_counter() - started)
        if step == 0:
            record["first_peak_GB"] = _status_gb("VmHWM")
    record.update(peak_GB=_status_gb("VmHWM"), rss_after_GB=_status_gb("VmRSS"))
    print(json.dumps(record), flush=True)


def _batch(rng: random.Random):
    import torch

    from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask

    prompts, responses = [], []
    for _ in range(GROUPS):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(40, 80))]
        for _ in range(GROUP_SIZE):
            length = min(MAX_RESPONSE, max(4, int(rng.expovariate(1 / MEAN_RESPONSE))))
            prompts.append(prompt)
            responses.append([rng.randrange(100, 40000) for _ in range(length)])
    batch = RolloutBatch(prompts=prompts, responses=responses)
    lengths = batch.response_lengths()
    batch.old_logprobs = [[-2.0] * n for n in lengths]
    batch.behaviour_logprobs = [[-2.0] * n for n in lengths]
    mask = response_mask(lengths)
    advantages = torch.tensor([rng.gauss(0, 1) for _ in lengths])[:, None] * mask
    return batch, advantages, mask


def _status_gb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        import run_all

        sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
