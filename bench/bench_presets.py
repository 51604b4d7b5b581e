"""Each rollout-correction preset (``algorithm.rollout_correction.preset``) on the default job.

Issue 30 asks that a run with each of verl's presets train the default job to its target
(held-out greedy accuracy 0.85), or that the docs say why a preset does not fit it. This runs
``configs/default.yaml`` itself (async, staleness 1, the tiny policy, 2-digit addition) with its
services in-process (``tests/unit/default_job_inprocess.py``: the transformers engine, the
arithmetic scorer, the trainer's own loop; no Redis or processes, so the preset is all that
differs), once per preset, validating on the 500 held-out prompts every ``--test-freq`` steps
and stopping at the first validation at or above the target, after ``--max-steps``, or when
``heldout_flat`` fires (its last 4 validations beat the first by no more than 0.001: it is
not learning). The health rules run with their defaults, so the table also says which fire.
``--set KEY=VALUE`` (repeatable) overrides the config after the preset, e.g. a rejection
threshold sized to the job's own mismatch; such a run is recorded as ``preset+KEY=VALUE``.

    nice -n 19 .venv/bin/python bench/bench_presets.py [--presets a,b] [--max-steps 1200] \
        [--set algorithm.rollout_correction.rollout_rs_threshold=0.1]

Writes ``bench/results/presets.json`` after every preset (a rerun keeps the presets it does not
run) and ``bench/results/presets.md``. The rejected fraction is that of the responses
(``rollout_rs_seq_masked_fraction``), as the mean of the first 50 steps and the median of the
run: a run that collapses changes little afterwards, so its median says little of its start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))
OUT = ROOT / "bench" / "results" / "presets.json"
HELDOUT = "val-core/arith/reward/mean@1"
REJECTED = "rollout_corr/rollout_rs_seq_masked_fraction"
GIVE_UP = "health/heldout_flat"
"""A run whose last 4 validations beat its first by no more than 0.001 is stopped there."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--max-steps", type=int, default=1200)
    parser.add_argument("--test-freq", type=int, default=50)
    parser.add_argument("--val-size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--set", action="append", default=[], help="config override KEY=VALUE")
    return parser.parse_args(argv)


def run_preset(name: str, args: argparse.Namespace) -> dict:
    """One run of the default job with ``name`` (and ``--set``); what it reached and what it
    watched."""
    from default_job_inprocess import default_job, train

    with tempfile.TemporaryDirectory() as run_dir:
        config = default_job(
            Path(run_dir),
            args.max_steps,
            f"algorithm.rollout_correction.preset={name}",
            f"trainer.test_freq={args.test_freq}",
            f"data.val_size={args.val_size}",
            f"trainer.seed={args.seed}",
            *args.set,
        )
        began = time.monotonic()
        target = config.trainer.target_accuracy
        rows = asyncio.run(
            train(
                config, stop=lambda row: row.get(HELDOUT, 0.0) >= target or bool(row.get(GIVE_UP))
            )
        )
    return summarize(run_key(name, args.set), rows, target, time.monotonic() - began)


def run_key(name: str, overrides: list[str]) -> str:
    """How a run is recorded: the preset, then its overrides (``+KEY=VALUE`` each)."""
    return "+".join([name, *overrides])


def summarize(name: str, rows: list[dict], target: float, wall_s: float) -> dict:
    steps = [r for r in rows if "training/global_step" in r]
    vals = [(r["step"], float(r[HELDOUT])) for r in rows if HELDOUT in r]
    reached = next((step for step, acc in vals if acc >= target), None)

    def stat(key: str, how=statistics.median) -> float | None:
        values = [float(r[key]) for r in steps if key in r]
        return round(how(values), 5) if values else None

    return {
        "preset": name,
        "steps": len(steps),
        "steps_to_target": reached,
        "heldout": [[step, round(acc, 4)] for step, acc in vals],
        "best_heldout": max((acc for _, acc in vals), default=None),
        "training_s": round(sum(float(r.get("timing_s/step", 0.0)) for r in steps), 1),
        "wall_s": round(wall_s, 1),
        "median_step_s": stat("timing_s/step"),
        "rollout_corr_kl_median": stat("rollout_corr/kl"),
        "chi2_token_median": stat("rollout_corr/chi2_token"),
        "rs_masked_fraction_median": stat(REJECTED),
        "rs_masked_fraction_first_50_mean": mean_of(steps[:50], REJECTED),
        "is_mean_median": stat("rollout_corr/rollout_is_mean"),
        "health_fired": sorted(
            {
                k.removeprefix("health/")
                for r in steps
                for k, v in r.items()
                if k.startswith("health/") and v
            }
        ),
    }


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [float(r[key]) for r in rows if key in r]
    return round(statistics.fmean(values), 5) if values else None


def markdown(results: dict[str, dict]) -> str:
    head = (
        "| preset | reached 0.85 at step | best held-out | steps run | training s | "
        "median s/step | rollout_corr/kl | chi2_token | responses rejected (steps 1-50 mean / "
        "median) | health rules fired |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    cells = lambda v: "-" if v is None or v == [] else str(v)  # noqa: E731
    lines = [
        f"| `{r['preset']}` | {cells(r['steps_to_target']) if r['steps_to_target'] else 'no'} | "
        f"{cells(r['best_heldout'])} | {r['steps']} | {r['training_s']} | "
        f"{cells(r['median_step_s'])} | {cells(r['rollout_corr_kl_median'])} | "
        f"{cells(r['chi2_token_median'])} | {rejected(r)} | "
        f"{', '.join(r['health_fired']) or 'none'} |"
        for r in results.values()
    ]
    return head + "\n".join(lines) + "\n"


def rejected(r: dict) -> str:
    """``first-50 mean / median``, ``-`` for a run without rejection (or recorded before the
    first-50 mean was)."""
    first, median = r.get("rs_masked_fraction_first_50_mean"), r["rs_masked_fraction_median"]
    if first is None:
        return "-" if median is None else f"? / {median}"
    return f"{first} / {median}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from rlfleet.common.config.rollout_correction import PRESETS

    names = [n for n in args.presets.split(",") if n] or list(PRESETS)
    unknown = sorted(set(names) - set(PRESETS))
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; choose from {list(PRESETS)}")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in names:
        key = run_key(name, args.set)
        results[key] = run_preset(name, args)
        print(json.dumps(results[key]), flush=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
