"""Why verl's rejection presets collapse the default job: what they reject, and a control.

``decoupled_k3_rs`` and ``decoupled_geo_rs`` drive the default job to 0 held-out accuracy
within 50 steps (``bench/bench_presets.py``). This measures the two things that explain it,
with the job in-process as ``bench_presets`` runs it (``tests/unit/default_job_inprocess.py``):

1. ``lag``: the divergence the rejection sees, per response, with nothing rejected
   (``decoupled_k3_rs`` at a threshold nothing reaches): the sequence mean of k3 and of |k1|
   of the actor's old log-probs against the engine's, their quantiles per span of steps and
   the share over verl's bounds (k3 > 0.01; geo: |k1| > log 1.001). Asynchronous (the job's
   mode: every batch is one update behind) and synchronous (engine and actor on the same
   weights: the engine's numerical mismatch alone).
2. ``control``: held-out accuracy after ``--steps`` for nothing rejected, for k3's rejection
   and for as many responses rejected at random each step, over ``--seeds``; and which
   advantages k3 rejects (negative against positive responses) and how likely the engine
   found the responses it keeps and those it rejects (median probability of the response).

    nice -n 19 .venv/bin/python bench/bench_rejection.py [--steps 100] [--seeds 0,1,2]

Writes ``bench/results/rejection.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
OUT = ROOT / "bench" / "results" / "rejection.json"
HELDOUT = "val-core/arith/reward/mean@1"
K3 = "algorithm.rollout_correction.preset=decoupled_k3_rs"
NOTHING = "algorithm.rollout_correction.rollout_rs_threshold=1e9"
SPANS = ((1, 1), (2, 10), (11, 50), (51, 100), (101, 200))


def run(steps: int, *overrides: str, hook=None) -> list[dict]:
    """The default job for ``steps`` steps (its 1,200-step schedule), 200 held-out prompts
    every 50 steps; ``hook(batch, mask, kept) -> kept`` sees each step's rejection."""
    from default_job_inprocess import default_job, train

    import rlfleet.trainer.trainer as trainer_module

    original = trainer_module.correct_batch

    def correct(batch, mask, config, actor_old):
        kept, metrics = original(batch, mask, config, actor_old)
        return (hook(batch, mask, kept) if hook else kept), metrics

    trainer_module.correct_batch = correct
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            config = default_job(
                Path(run_dir), 1200, "trainer.test_freq=50", "data.val_size=200", *overrides
            )
            done = lambda row: row.get("training/global_step", 0) >= steps  # noqa: E731
            return asyncio.run(train(config, stop=done))
    finally:
        trainer_module.correct_batch = original


def lag(steps: int, *overrides: str) -> dict[str, dict]:
    """Quantiles of the per-response divergences the rejection would see, per span of steps."""
    from rlfleet.rl.rollout_correction import divergences, sequence_stat
    from rlfleet.rl.sequences import pad_rows

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def measure(batch, mask, kept):
        width = mask.shape[1]
        log_ratio = pad_rows(batch.old_logprobs, width) - pad_rows(batch.engine_logprobs, width)
        per_token = divergences(log_ratio)
        k3 = sequence_stat(per_token["k3"], mask, "mean")
        seen.append((k3, sequence_stat(per_token["k1"], mask, "mean").abs()))
        return kept

    run(steps, K3, NOTHING, *overrides, hook=measure)
    quantiles = torch.tensor([0.5, 0.9, 0.99])
    out = {}
    for first, last in SPANS:
        if first > len(seen):
            break
        k3 = torch.cat([s[0] for s in seen[first - 1 : last]])
        k1 = torch.cat([s[1] for s in seen[first - 1 : last]])
        out[f"steps {first}-{min(last, len(seen))}"] = {
            "k3_q50_q90_q99": [round(v, 4) for v in k3.quantile(quantiles).tolist()],
            "k3_over_0.01": round(float((k3 > 0.01).float().mean()), 3),
            "abs_k1_q50_q90_q99": [round(v, 4) for v in k1.quantile(quantiles).tolist()],
            "abs_k1_over_log_1.001": round(float((k1 > math.log(1.001)).float().mean()), 3),
        }
    return out


def control(steps: int, seed: int) -> dict[str, list]:
    """Held-out accuracy at each validation: nothing rejected, k3, random; and k3's rejected
    share of negative- and positive-advantage responses (rows with a nonzero score spread)."""
    from rlfleet.rl.sequences import pad_rows

    picks = torch.Generator().manual_seed(seed)
    sides = {"negative": [0, 0], "positive": [0, 0]}
    likely: dict[str, list[float]] = {"kept": [], "rejected": []}

    def at_random(batch, mask, kept):
        count = int(((mask > 0) & (kept == 0)).any(-1).sum())
        shuffled = mask.clone()
        shuffled[torch.randperm(len(mask), generator=picks)[:count]] = 0
        return shuffled

    def sides_of(batch, mask, kept):
        scores = torch.tensor(batch.scores)
        groups = torch.tensor(batch.group_ids)
        mean = torch.stack([scores[groups == g].mean() for g in groups])
        rejected = ((mask > 0) & (kept == 0)).any(-1)
        engine = (pad_rows(batch.engine_logprobs, mask.shape[1]) * mask).sum(-1).exp()
        likely["kept"] += engine[~rejected].tolist()
        likely["rejected"] += engine[rejected].tolist()
        for name, rows in (("negative", scores < mean), ("positive", scores > mean)):
            sides[name][0] += int((rows & rejected).sum())
            sides[name][1] += int(rows.sum())
        return kept

    def accuracy(rows):
        return [[r["step"], round(float(r[HELDOUT]), 3)] for r in rows if HELDOUT in r]

    seeded = f"trainer.seed={seed}"
    return {
        "nothing_rejected": accuracy(run(steps, K3, NOTHING, seeded)),
        "k3": accuracy(run(steps, K3, seeded, hook=sides_of)),
        "random_as_many": accuracy(run(steps, K3, seeded, hook=at_random)),
        "k3_rejected_share": {k: round(r / max(1, n), 3) for k, (r, n) in sides.items()},
        "k3_median_response_probability": {
            k: round(float(torch.tensor(v).median()), 3) if v else None for k, v in likely.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lag-steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    results = {
        "lag_async": lag(args.lag_steps),
        "lag_sync": lag(20, "trainer.mode=sync"),
    }
    print(json.dumps(results, indent=1), flush=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        results[f"control_seed_{seed}"] = control(args.steps, seed)
        print(json.dumps(results[f"control_seed_{seed}"]), flush=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
