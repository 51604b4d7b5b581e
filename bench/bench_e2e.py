"""End to end: TRL's GRPOTrainer against the whole rlfleet fleet (sync and async), same job.

Why: the project's claim is that a fleet of services trains as fast as the single-process
peer people reach for first. This runs both on the default job (the tiny policy, data/arith,
rlfleet's arith score, group size 8, 8 new tokens; TRL with 2 torch threads), one run after
another on the same machine, and reports:

(a) seconds per step at equal work (32 prompts x 8 samples, and 8 x 8), per-phase medians,
    CPU seconds per step by process, Redis commands and bytes, bytes on the gRPC sockets;
(b) training time until greedy held-out accuracy (data/arith/test.jsonl, 500 problems) first
    reaches the target, evaluation time excluded on both sides, for rlfleet's recipe and for
    each TRL recipe (the best one is named), over several seeds, capped by a time budget.

Usage: ``python bench/bench_e2e.py [--quick] [--only trl,sync,async] [--seeds 0,1] [--steps N]
[--budget-s S]``, or ``make bench-e2e``. Not part of ``run_all.py``: a full run takes about an
hour of a 2-core machine (``--quick``: a few minutes). Results: bench/results/e2e.json, e2e.md,
and its line in SUMMARY.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import common

NAME = "e2e"
TITLE = "End to end: rlfleet (sync, async) vs TRL GRPOTrainer"
SYSTEMS = ("trl", "sync", "async")
BATCHES = (32, 8)


def default_recipe() -> dict:
    """configs/default.yaml (the job ``make run`` trains) in TRL's terms: prompts per batch,
    lr and its schedule over the job's steps, sampling temperature, optimizer steps per
    generated batch (``ppo_mini_batch_size``), no KL."""
    from rlfleet.common.config import load_config

    config = load_config(common.REPO / "configs" / "default.yaml", [])
    batch, trainer = config.data.train_batch_size, config.trainer
    sequences = batch * config.rollout.n
    return {
        "batch": batch,
        "lr": trainer.lr,
        "schedule": trainer.lr_schedule,
        "steps": trainer.total_steps,
        "beta": 0.0,
        "temperature": config.rollout.temperature,
        "steps_per_generation": sequences // (trainer.ppo_mini_batch_size or sequences),
    }


TRL_RECIPES = {
    "ours": default_recipe(),  # rlfleet's default job, the same recipe run by TRL
    "trl": {"batch": 8, "lr": 1e-4, "schedule": "linear", "steps": 1500, "beta": 0.0},
}


@dataclass
class Plan:
    systems: list[str]
    seeds: list[int]
    steps: int
    warmup: int
    budget_s: float
    eval_every: int
    target: float
    trl_recipes: list[str]
    batches: list[int]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, one seed (a smoke run)")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="subset of trl,sync,async")
    parser.add_argument("--seeds", default=None, help="seeds for (b), comma-separated (0,1)")
    parser.add_argument("--steps", type=int, default=None, help="steps of each (a) run (30)")
    parser.add_argument("--budget-s", type=float, default=None, help="(b) training-time cap (600)")
    parser.add_argument("--eval-every", type=int, default=10, help="(b) eval period at 32 prompts")
    parser.add_argument("--target", type=float, default=0.85, help="held-out accuracy target")
    parser.add_argument("--trl-recipes", default=",".join(TRL_RECIPES), help="(b) TRL recipes")
    parser.add_argument("--skip-speed", action="store_true", help="only (b)")
    parser.add_argument("--skip-ttt", action="store_true", help="only (a)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="results folder")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(_items(args.only)) - set(SYSTEMS) | set(_items(args.trl_recipes)) - set(
        TRL_RECIPES
    )
    if unknown:
        parser.error(f"unknown {sorted(unknown)}: systems {SYSTEMS}, recipes {list(TRL_RECIPES)}")
    return args


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def plan_from(args: argparse.Namespace) -> Plan:
    quick = args.quick
    seeds = [int(s) for s in _items(args.seeds)] if args.seeds else ([0] if quick else [0, 1])
    return Plan(
        systems=[s for s in SYSTEMS if s in _items(args.only)],
        seeds=seeds,
        steps=args.steps or (4 if quick else 30),
        warmup=1 if quick else 3,
        budget_s=args.budget_s or (30.0 if quick else 600.0),
        eval_every=5 if quick else args.eval_every,
        target=args.target,
        trl_recipes=_items(args.trl_recipes)[:1] if quick else _items(args.trl_recipes),
        batches=list(BATCHES[:1] if quick else BATCHES),
    )


def speed_run(system: str, batch: int, plan: Plan, work: Path) -> dict:
    """One (a) run: ``plan.steps`` steps of ``batch`` prompts x 8 samples, no evaluation."""
    import e2e_fleet
    import e2e_trl

    common.progress(f"(a) {system} {batch}x8, {plan.steps} steps")
    if system == "trl":
        flags = {
            **TRL_RECIPES["ours"],
            "batch": batch,
            "steps": plan.steps,
            "threads": 2,
            "steps_per_generation": 1,
        }
        record = e2e_trl.launch(flags, work / f"trl-{batch}x-speed.json", 60.0 * plan.steps + 300)
    else:
        per_generation = TRL_RECIPES["ours"]["steps_per_generation"]  # TRL's optimizer steps
        mini = f"trainer.ppo_mini_batch_size={batch * 8 // per_generation}"
        run = e2e_fleet.FleetRun(system, batch, plan.steps, warmup=plan.warmup, overrides=[mini])
        record = e2e_fleet.run_fleet(run, work, 60.0 * plan.steps + 300)
    return {**record, "part": "speed", "system": system, "batch": batch}


def ttt_run(system: str, seed: int, plan: Plan, work: Path, recipe: str | None = None) -> dict:
    """One (b) run: train until held-out >= target or the training-time budget is spent."""
    import e2e_fleet
    import e2e_trl

    common.progress(f"(b) {system} {recipe or ''} seed {seed}, budget {plan.budget_s:.0f}s")
    timeout = 3 * plan.budget_s + 600
    if system == "trl":
        flags = {
            **TRL_RECIPES[recipe],
            "seed": seed,
            "threads": 2,
            "budget_s": plan.budget_s,
            "eval_every": plan.eval_every * 32 // TRL_RECIPES[recipe]["batch"],
            "target": plan.target,
        }
        record = e2e_trl.launch(flags, work / f"trl-{recipe}-ttt-s{seed}.json", timeout)
        record.update(recipe=recipe, batch=flags["batch"])
    else:
        ours = TRL_RECIPES["ours"]  # the default job: its batch and schedule length
        eval_every = max(1, plan.eval_every * 32 // ours["batch"])
        run = e2e_fleet.FleetRun(
            system,
            ours["batch"],
            ours["steps"],
            seed,
            eval_every,
            plan.budget_s,
            plan.target,
            warmup=plan.warmup,
        )
        record = e2e_fleet.run_fleet(run, work, timeout)
        record["recipe"] = f"rlfleet default ({system})"
    return {**record, "part": "ttt", "system": system, "seed": seed}


def run_plan(plan: Plan, work: Path) -> list[dict]:
    """Every run, one after the other: (a) by batch size, then (b) by seed."""
    records = []
    for batch in plan.batches:
        for system in plan.systems:
            records.append(guarded(speed_run, "speed", system, batch, plan, work))
    for seed in plan.seeds:
        for system in (s for s in plan.systems if s != "trl"):
            records.append(guarded(ttt_run, "ttt", system, seed, plan, work))
        for recipe in plan.trl_recipes if "trl" in plan.systems else []:
            records.append(guarded(ttt_run, "ttt", "trl", seed, plan, work, recipe))
    return records


def guarded(fn, part: str, system: str, *args) -> dict:
    """A run that raised becomes a record carrying the error; the other runs still happen."""
    try:
        return fn(system, *args)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, and shown
        common.progress(f"{part} {system} failed: {exc!r}")
        key = "batch" if part == "speed" else "seed"
        record = {"part": part, "system": system, "batch": 32, "seed": 0, "steps": [], "evals": []}
        return {**record, key: args[0], "error": repr(exc)}


def build_result(plan: Plan, records: list[dict]) -> tuple[common.BenchResult, str]:
    import e2e_report as report

    speed = [r for r in records if r["part"] == "speed"]
    ttt = [r for r in records if r["part"] == "ttt"]
    rows = [report.speed_row(r, plan.warmup) for r in speed]
    ttt_rows = [report.ttt_row(r, plan.target) for r in ttt]
    result = common.BenchResult(
        NAME,
        TITLE,
        report.SPEED_COLUMNS,
        rows,
        ratios(rows, ttt, plan),
        asdict(plan),
        notes(ttt, plan),
    )
    return result, report.markdown(rows, report.cpu_rows(speed, plan.warmup), ttt_rows)


def ratios(rows: list[dict], ttt: list[dict], plan: Plan) -> dict[str, float]:
    """rlfleet / TRL: time to target first (SUMMARY.md shows the first three), then s/step."""
    import e2e_report as report

    out = {}
    best = report.best_trl_recipe(ttt, plan.target)
    theirs = report.median_ttt(ttt, "trl", best)
    for mode in ("sync", "async"):
        ours = report.median_ttt(ttt, mode)
        if ours is not None and theirs is not None:
            out[f"{mode}/trl({best}) time to {plan.target:g}"] = common.ratio(ours, theirs)
    per_step = {(r["system"], r["work"]): r.get("s/step median") for r in rows}
    for work in (f"{b}x8" for b in plan.batches):
        for mode in ("sync", "async"):
            a, b = per_step.get((mode, work)), per_step.get(("trl", work))
            if isinstance(a, float) and isinstance(b, float):
                out[f"{mode}/trl s per step {work}"] = common.ratio(a, b)
    return out


def notes(ttt: list[dict], plan: Plan) -> list[str]:
    import e2e_report as report

    out = [
        "s/step median: median step time after the first "
        f"{plan.warmup} steps; s/step clock: training clock (evaluation excluded) / steps.",
        "gRPC KB/step: bytes on the server side of the fleet's TCP listening sockets (Redis "
        "excluded), HTTP/2 framing included. gRPC calls per step are in each run's "
        "metrics.jsonl (`perf/grpc_calls/<Method>`, counted by the trainer's channels).",
        "TRL (a) runs use the 'ours' recipe at the row's batch size (beta 0: no reference "
        "model), two optimizer steps per generated batch like the fleet's rows.",
        "Both sides run with OMP_WAIT_POLICY=PASSIVE (rlfleet up sets it for every role; TRL's "
        "process gets it too): on a busy machine spinning OpenMP threads cost TRL ~3x per step.",
        "Both sides load the policy with configs/default.yaml's model.attn_implementation "
        "(eager: the faster kernel for these ~15-token sequences on CPU, "
        "bench/results/actor_update.md). What rlfleet has and TRL lacks is its own: one "
        "forward per distinct prompt in the actor's update (trainer.share_prompt_forward).",
    ]
    best = report.best_trl_recipe(ttt, plan.target)
    if best is not None:
        reached = report.median_ttt(ttt, "trl", best)
        verdict = (
            f"median {reached:.0f} s" if reached is not None else "did NOT reach it in every seed"
        )
        out.append(
            f"Best TRL recipe: '{best}' {TRL_RECIPES[best]}: {verdict} "
            f"(target {plan.target}, budget {plan.budget_s:.0f} s of training)."
        )
    return out


def run(options: common.Options) -> common.BenchResult:
    """run_all's entry point (the e2e benchmark is not registered there: it is too long)."""
    plan = plan_from(parse_args(["--quick"] if options.quick else []))
    return build_result(plan, run_plan(plan, options.work_dir))[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    plan = plan_from(args)
    if args.skip_speed:
        plan.batches = []
    if args.skip_ttt:
        plan.seeds = []
    work = args.out / "work" / "e2e"
    machine, start, load_before = common.machine_info(), time.monotonic(), common.load_avg()
    records = run_plan(plan, work)
    failed = [r for r in records if r.get("error")]
    if not failed:  # a failed run's logs stay under work/ for its error message
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):  # work/ is shared: removed only when empty
            work.parent.rmdir()
    result, tables = build_result(plan, records)
    result.seconds = time.monotonic() - start
    result.load_avg = {"before": load_before, "after": common.load_avg()}
    write(result, machine, tables, records, args.out)
    print(f"{NAME}: " + "; ".join(f"{k} = {common.fmt(v)}" for k, v in result.ratios.items()))
    return 1 if failed else 0


def write(result, machine, tables: str, records: list[dict], out: Path) -> None:
    """e2e.json (everything, every run's raw record), e2e.md (the tables), SUMMARY.md."""
    import run_all

    path = common.write_result(result, machine, out)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "runs": records}, indent=1, default=str) + "\n")
    title, measured, rest = common.result_markdown(replace(result, rows=[]), machine).split(
        "\n\n", 2
    )
    (out / f"{NAME}.md").write_text("\n\n".join([title, measured, tables, rest]))
    common.progress(f"summary -> {run_all.write_summary(out)}")


if __name__ == "__main__":
    sys.exit(main())
