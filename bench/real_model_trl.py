"""One run of TRL's GRPOTrainer on SmolLM2-135M-Instruct, for bench_real_model.py.

Why a separate script: like ``e2e_trl.py`` (whose phase timer and thread setting it reuses),
it runs as its own process, so it gets exactly the torch threads it is given, its peak RSS is
its own and TRL's imports never touch the harness. It writes one JSON file: per-step wall and
phase times (gen, reward, update), held-out greedy success before and after, peak RSS.

Same work as the fleet's recipe (``configs/grpo_countdown_smollm2.yaml``, or
``configs/grpo_smollm2_math.yaml`` for the ``learn`` section): its train Parquet, the prompt as
chat messages (TRL renders a conversational prompt with the model's chat template; the ids it
feeds are compared with what rlfleet's trainer feeds, ``encode_prompt`` under
``data.apply_chat_template: auto``, and a difference stops the run), rlfleet's own scorer of
each row's data source as the reward, group size, completion length, lr, temperature, batch and threads.

Usage: ``python bench/real_model_trl.py --out run.json --batch 4 --n 4 --max-tokens 96
--steps 4 [--budget-s 0] [--val-size 16] [--eval-every-s 0] [--sft-file F --sft-steps N]``;
with ``--eval-every-s`` the held-out set is also scored each time the training clock passes
another multiple of it (the learning curve against training time; evaluation is not on the
clock); with ``--sft-steps`` an SFT warm-up runs first (``real_model_trl_sft.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import real_model_trl_sft  # noqa: E402
from e2e_trl import CHILD_ENV, PhaseTimer  # noqa: E402

MODEL = "smollm2-135m-instruct"
DATA = Path("~/.cache/rlfleet/data/countdown").expanduser()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--batch", type=int, default=4, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    parser.add_argument("--max-tokens", type=int, default=96, help="new tokens per sample")
    parser.add_argument("--max-prompt-length", type=int, default=160)
    parser.add_argument("--steps", type=int, default=4, help="max_steps (a cap when budgeted)")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--bf16",
        type=int,
        default=0,
        help="1: bf16 autocast (the fleet's trainer.autocast_dtype=bfloat16)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop once this much training time is spent (0: run --steps)",
    )
    parser.add_argument("--val-size", type=int, default=0, help="held-out rows (0: no eval)")
    parser.add_argument(
        "--eval-every-s",
        type=float,
        default=0.0,
        help="also evaluate every this many training seconds (0: ends only)",
    )
    parser.add_argument("--train-file", type=Path, default=DATA / "train.parquet")
    parser.add_argument("--test-file", type=Path, default=DATA / "test.parquet")
    parser.add_argument("--work-dir", type=Path, default=common.RESULTS_DIR / "work" / "trl")
    real_model_trl_sft.add_flags(parser)
    return parser.parse_args(argv)


def read_records(path: Path, limit: int | None = None) -> list:
    """rlfleet's own reading of a verl-schema file (``PromptRecord``: messages, truth)."""
    from rlfleet.trainer.data import read_rows, to_record

    rows = read_rows(path)[:limit]
    return [to_record(row, f"{path}:{i + 1}") for i, row in enumerate(rows)]


def scores_of(texts: list[str], sources: list[str], truths: list) -> list[float]:
    """Each response scored by the built-in scorer its row's ``data_source`` selects (the
    reward service's own choice; an unscorable response counts 0, as in rlfleet's training)."""
    from rlfleet.common.config import RewardConfig
    from rlfleet.reward.scorers import build_registry
    from rlfleet.reward.types import ScoreRequest

    registry = build_registry(RewardConfig())
    out = []
    for index, (text, source, truth) in enumerate(zip(texts, sources, truths, strict=True)):
        request = ScoreRequest(f"trl-{index}", source, text, truth, {})
        [result] = registry.select(request).score_many([request])
        out.append(0.0 if result.error else float(result.score))
    return out


def row_reward(completions, ground_truth, data_source, **_) -> list[float]:
    """TRL's reward function: rlfleet's scorers, selected by each row's data source."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return scores_of(texts, list(data_source), [json.loads(g) for g in ground_truth])


def held_out(model, tokenizer, records: list, max_tokens: int) -> float:
    """Greedy success on ``records`` as rlfleet's validation scores it (same ids, scorer)."""
    from rlfleet.model.model_io import greedy_completions

    if not records:
        return float("nan")
    was_training = model.training
    model.eval()
    texts = greedy_completions(model, tokenizer, [r.prompt for r in records], max_tokens, 64)
    model.train(was_training)
    scores = scores_of(texts, [r.data_source for r in records], [r.ground_truth for r in records])
    return sum(scores) / len(scores)


def run_settings(args: argparse.Namespace, output_dir: Path) -> dict:
    """What every TRL trainer of this run is given alike (CPU, precision, seeds, a constant lr
    without warm-up, no saving or console logging)."""
    return {
        "output_dir": str(output_dir),
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "use_cpu": True,
        "bf16": bool(args.bf16),
        "seed": args.seed,
        "data_seed": args.seed,
        "gradient_accumulation_steps": 1,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "dataloader_num_workers": 0,
    }


def grpo_config(args: argparse.Namespace):
    from trl import GRPOConfig

    return GRPOConfig(
        **run_settings(args, args.work_dir),
        per_device_train_batch_size=args.batch * args.n,
        num_generations=args.n,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=0.0,
    )


def check_prompt_ids(trainer, tokenizer, record) -> list[int]:
    """The ids TRL feeds for a conversational prompt must be rlfleet's; else stop loudly."""
    from rlfleet.model.model_io import encode_prompt

    ids = [int(i) for i in trainer._tokenize_prompts([record.prompt])[0][0]]
    want = encode_prompt(tokenizer, record.prompt, "auto")
    if ids != want:
        raise RuntimeError(f"TRL feeds {ids}, rlfleet {want}: the comparison would be unfair")
    return ids


def evaluator(args, tokenizer, test: list, record: dict):
    """``evaluate(model, step)``: held-out success, timed off the clock, kept in the curve."""

    def evaluate(model, step: int = 0) -> float | None:
        if not test:
            return None
        started = time.perf_counter()
        value = held_out(model, tokenizer, test, args.max_tokens)
        record["eval_s"].append(time.perf_counter() - started)
        record["curve"].append([step, record["training_time_s"], value])
        common.progress(f"trl held-out: {value:.3f} ({len(test)} rows)")
        save(args.out, record)
        return value

    return evaluate


def callback(args, evaluate, phases: PhaseTimer, record: dict):
    """Training clock (evaluation excluded), phases per step, the budget, evals at both ends."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_):
            if "val_before" not in record:  # else scored before the SFT warm-up
                record["val_before"] = self._evaluate(model)
            every = args.eval_every_s
            self.next_eval = every * (1 + int(record["training_time_s"] // every)) if every else 0
            self.mark = time.perf_counter()

        def on_step_end(self, _args, state, control, model=None, **_):
            step_s = time.perf_counter() - self.mark
            record["training_time_s"] += step_s
            times = phases.take()
            row = {"step": state.global_step, "step_s": step_s, **times}
            row["update"] = step_s - times.get("prepare", 0.0)
            row["prepare_other"] = (
                times.get("prepare", 0.0) - times.get("gen", 0.0) - times.get("reward", 0.0)
            )
            record["steps"].append(row)
            common.progress(f"trl step {state.global_step}: {step_s:.1f} s")
            save(args.out, record)  # a run stopped by the harness's timeout keeps its steps
            if args.budget_s and record["training_time_s"] >= args.budget_s:
                control.should_training_stop = True
                record["stopped_by"] = "budget spent"
            elif args.eval_every_s and record["training_time_s"] >= self.next_eval:
                self.next_eval += args.eval_every_s
                self._evaluate(model, state.global_step)
            self.mark = time.perf_counter()

        def on_train_end(self, _args, state, control, model=None, **_):
            record["val_after"] = self._evaluate(model, state.global_step)

        def on_log(self, _args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                record["reward"].append([state.global_step, logs["reward"]])

        def _evaluate(self, model, step: int = 0) -> float | None:
            return evaluate(model, step + args.sft_steps)  # steps counted as the fleet does

    return Clock()


def build_trainer(args: argparse.Namespace, record: dict):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import GRPOTrainer

    from rlfleet.model.local_models import resolve_local_model
    from rlfleet.model.model_io import load_tokenizer

    path = resolve_local_model(MODEL)
    tokenizer = load_tokenizer(path)
    train = read_records(args.train_file)
    rows = [
        {
            "prompt": r.prompt,
            "ground_truth": json.dumps(r.ground_truth),
            "data_source": r.data_source,
        }
        for r in train
    ]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype="float32")
    test = read_records(args.test_file, args.val_size) if args.val_size else []
    evaluate = evaluator(args, tokenizer, test, record)
    if args.sft_steps:
        settings = run_settings(args, args.work_dir / "sft")
        real_model_trl_sft.warm_up(args, model, tokenizer, record, evaluate, settings)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=row_reward,
        args=grpo_config(args),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    record["prompt_ids_example"] = check_prompt_ids(trainer, tokenizer, train[0])
    trainer.remove_callback(PrinterCallback)  # the harness reads the JSON, not stdout
    trainer.add_callback(callback(args, evaluate, PhaseTimer(trainer), record))
    return trainer


def peak_rss_gb() -> float:
    """This process's VmHWM in GiB (the 3 GB target is per process)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def launch(flags: dict, out: Path, timeout_s: float) -> dict:
    """Run this script as a child (``e2e_trl.CHILD_ENV``: OMP_WAIT_POLICY=PASSIVE, as
    ``rlfleet up`` gives its roles); its JSON record, with an error when it failed."""
    import os
    import signal
    import subprocess

    argv = [sys.executable, __file__, "--out", str(out), "--work-dir", str(out.parent / out.stem)]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    load_before = common.load_avg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    log_path = out.parent / f"{out.stem}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=CHILD_ENV, start_new_session=True
        )
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    record = json.loads(out.read_text()) if out.is_file() else {"steps": []}
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-1500:]
        record["error"] = f"real_model_trl.py exited {proc.returncode}: {tail}"
    record["load_avg"] = {"before": load_before, "after": common.load_avg()}
    return record


def save(out: Path, record: dict) -> None:
    record["peak_rss_GB"] = peak_rss_gb()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    record = {
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "steps": [],
        "reward": [],
        "eval_s": [],
        "training_time_s": 0.0,
        "stopped_by": None,
        "curve": [],
    }
    started = time.perf_counter()
    trainer = build_trainer(args, record)
    trainer.train()
    record["wall_time_s"] = time.perf_counter() - started
    record["stopped_by"] = record["stopped_by"] or "max_steps"
    save(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
