"""Run rlfleet's benchmarks and write bench/results/<name>.json, <name>.md and SUMMARY.md.

Usage: ``python bench/run_all.py [--quick] [--only engines,queue,weights]``. The whole set takes
a few minutes on a 2-core machine (``--quick``: about a minute). Heavy imports happen inside
each benchmark's ``run``, after the arguments are parsed, so ``--help`` is instant.

A failing benchmark is recorded (its JSON carries the error) and the others still run; the exit
status is 1 if any failed. SUMMARY.md is rebuilt from every result JSON in the output folder, so
running a subset keeps the other benchmarks' latest results in the summary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import shutil
import sys
import time
import traceback
from pathlib import Path

import common

BENCHES = {
    "engines": "bench_engines",
    "queue": "bench_queue",
    "weights": "bench_weights",
    "reward_throughput": "bench_reward_throughput",
    "router": "bench_router",
    "ddp": "bench_ddp",
    "actor_update": "bench_actor_update",
    "agent": "bench_agent",
    "inflight": "bench_inflight",
    "real_model": "bench_real_model",
    "trainer_memory": "bench_trainer_memory",
    "weights_relay": "bench_weights_relay",
    "tinker": "bench_tinker",
}
OPT_IN = {"real_model", "inflight", "trainer_memory", "weights_relay", "tinker"}
"""Run only when named in ``--only``: slow (real_model, trainer_memory: ``make smollm2``, 10-20
minutes each; tinker: a whole ``rlfleet up``, 2-10 minutes)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    subset = f"comma-separated subset of {','.join(BENCHES)} (repeatable)"
    parser.add_argument("--only", action="append", default=[], help=subset)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="model dtype for the engine and weight benchmarks",
    )
    parser.add_argument(
        "--hf-threads",
        type=int,
        default=1,
        help="torch threads of the hf engine (default 1, like rollout.torch_threads)",
    )
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="results folder")
    parser.add_argument("-v", "--verbose", action="store_true", help="INFO logs (rlfleet, vLLM)")
    args = parser.parse_args(argv)
    names = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}")
    args.names = [n for n in BENCHES if n in names or not names and n not in OPT_IN]
    return args


def run_one(name: str, options: common.Options) -> common.BenchResult:
    """Run a benchmark; an exception becomes a result that carries the error."""
    module = importlib.import_module(BENCHES[name])
    start, load_before = time.monotonic(), common.load_avg()
    try:
        result = module.run(options)
    except Exception as exc:  # noqa: BLE001 - recorded, and the other benchmarks still run
        traceback.print_exc()
        result = common.BenchResult(name, module.TITLE, [], [], {}, error=repr(exc))
    result.seconds = time.monotonic() - start
    result.load_avg = {"before": load_before, "after": common.load_avg()}
    return result


def headline(result: dict) -> str:
    if result.get("error"):
        return f"FAILED: {result['error'][:120]}"
    items = list(result.get("ratios", {}).items())[:3]
    if not items:
        return "no ratios: " + (result.get("notes") or ["?"])[-1][:120]
    return "; ".join(f"{name} = {common.fmt(value)}" for name, value in items)


def write_summary(out_dir: Path) -> Path:
    """SUMMARY.md: one line per benchmark whose JSON is in ``out_dir``."""
    lines = [
        "# rlfleet benchmark summary",
        "",
        "Ratios come from variants measured side by side in the same run.",
        "",
        "| benchmark | measured | seconds | headline ratios |",
        "|---|---|---|---|",
    ]
    for path in sorted(out_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if "title" not in data:  # not a benchmark result (e.g. gpu_check.json)
            continue
        when = data.get("machine", {}).get("timestamp", "?")
        link = f"[{data['title']}]({path.stem}.md)"
        lines.append(f"| {link} | {when} | {data.get('seconds', 0):.0f} | {headline(data)} |")
    machine = common.machine_info()
    lines += ["", "Machine now: " + ", ".join(f"{k}={v}" for k, v in machine.items()), ""]
    summary = out_dir / "SUMMARY.md"
    summary.write_text("\n".join(lines))
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    options = common.Options(
        quick=args.quick,
        dtype=args.dtype,
        hf_threads=args.hf_threads,
        verbose=args.verbose,
        work_dir=args.out / "work",
    )
    failed = []
    try:
        for name in args.names:
            common.progress(f"== {name} {'(quick)' if args.quick else ''}")
            machine = common.machine_info()
            result = run_one(name, options)
            path = common.write_result(result, machine, args.out)
            common.progress(f"== {name} done in {result.seconds:.0f}s -> {path}")
            print(f"{name}: {headline(json.loads(path.read_text()))}", flush=True)
            if result.error:
                failed.append(name)
    finally:
        shutil.rmtree(options.work_dir, ignore_errors=True)
    common.progress(f"summary -> {write_summary(args.out)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
