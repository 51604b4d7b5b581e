"""One run of TRL's GRPOTrainer on the default job's policy, data and reward, for bench_e2e.py.

Why a separate script: bench_e2e.py starts it as its own process, so the run gets exactly the
torch threads it is given, its CPU seconds are its own, and TRL's imports never touch the
harness. It writes one JSON file: per-step wall and phase times, the sampled reward, greedy
held-out accuracy at every evaluation, and the training clock (evaluation time excluded).

Same ids as rlfleet: the policy was trained with ``<bos>`` first. TRL 1.16 tokenizes a plain
text prompt with ``processing_class(text=...)``, i.e. *with* the tokenizer's special tokens, so
the prompt text gets a literal ``<bos>`` only when that call would otherwise leave it out. The
choice is made by comparing ids, and checked again on the trainer itself before training.

Usage: ``python bench/e2e_trl.py --out run.json --batch 32 --steps 20 [--eval-every 10 ...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

TRAIN_DATA = common.REPO / "data" / "arith" / "train.jsonl"
CHILD_ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "MALLOC_MMAP_THRESHOLD_": "1048576"}
"""What ``rlfleet up`` gives every role (``rlfleet.launch.process.ROLE_ENV_DEFAULTS``): torch
threads that sleep rather than spin while waiting, big blocks returned to the system when freed.
Same for TRL, so neither side is penalised (or its peak RSS inflated) by the defaults."""
PHASES = {"gen": "_generate", "reward": "_calculate_rewards", "prepare": "_prepare_inputs"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="result JSON")
    parser.add_argument("--batch", type=int, default=32, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    parser.add_argument("--max-tokens", type=int, default=8, help="new tokens per sample")
    parser.add_argument("--steps", type=int, default=20, help="max_steps (sets the lr schedule)")
    parser.add_argument("--lr", type=float, default=1.5e-4)
    parser.add_argument("--schedule", default="linear", choices=["linear", "constant"])
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (TRL's default 0)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument(
        "--steps-per-generation",
        type=int,
        default=1,
        help="optimizer steps per generated batch (mini-batches, like ppo_mini_batch_size)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--eval-every", type=int, default=0, help="greedy held-out eval period")
    parser.add_argument("--target", type=float, default=0.85, help="stop once eval reaches it")
    parser.add_argument("--budget-s", type=float, default=0.0, help="stop after this training time")
    parser.add_argument("--work-dir", type=Path, default=common.RESULTS_DIR / "work" / "trl")
    return parser.parse_args(argv)


def read_problems(path: Path) -> list[tuple[str, str]]:
    """(prompt text, ground truth) of every row of a verl-schema arith file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["prompt"][0]["content"], str(r["reward_model"]["ground_truth"])) for r in rows]


def prompt_prefix(tokenizer) -> str:
    """``""`` when TRL's plain-text tokenization already yields rlfleet's ids, else ``"<bos>"``."""
    from rlfleet.model.model_io import encode_prompt

    sample = "12+34="
    want = encode_prompt(tokenizer, sample)
    for prefix in ("", tokenizer.bos_token):
        if tokenizer(text=[prefix + sample])["input_ids"][0] == want:
            return prefix
    raise RuntimeError("no prompt text makes TRL's tokenization match rlfleet's ids")


def arith_reward(completions, ground_truth, **_) -> list[float]:
    """rlfleet's own arith score: 1.0 when the completion starts with the right sum."""
    from rlfleet.tasks.arith import score

    return [score(text, truth) for text, truth in zip(completions, ground_truth, strict=True)]


def greedy_accuracy(model, tokenizer, problems: list[tuple[str, str]], max_tokens: int) -> float:
    """Held-out accuracy as rlfleet measures it: greedy, same ids, same score."""
    from rlfleet.model.model_io import greedy_completions
    from rlfleet.tasks.arith import score

    was_training = model.training
    model.eval()
    texts = greedy_completions(model, tokenizer, [p for p, _ in problems], max_tokens)
    model.train(was_training)
    return sum(score(t, g) for t, (_, g) in zip(texts, problems, strict=True)) / len(problems)


def grpo_config(args: argparse.Namespace):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(args.work_dir),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        data_seed=args.seed,
        per_device_train_batch_size=args.batch * args.n // args.steps_per_generation,
        num_generations=args.n,
        steps_per_generation=args.steps_per_generation,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        max_steps=args.steps * args.steps_per_generation,
        learning_rate=args.lr,
        lr_scheduler_type=args.schedule,
        warmup_steps=0,
        beta=args.beta,
        dataloader_num_workers=0,
    )


class PhaseTimer:
    """Wraps a few of the trainer's own methods to add up their time per step."""

    def __init__(self, trainer) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        for phase, method in PHASES.items():
            setattr(trainer, method, self._timed(phase, getattr(trainer, method)))

    def _timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        return wrapper

    def take(self) -> dict[str, float]:
        taken, self.totals = dict(self.totals), defaultdict(float)
        return taken


def step_callback(args, tokenizer, test, phases: PhaseTimer, record: dict):
    """A TrainerCallback keeping the training clock (evaluation excluded) and the stop rules."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **_):
            self._evaluate(state, model)
            self.mark, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, _args, state, control, model=None, **_):
            step_s = time.perf_counter() - self.mark
            record["training_time_s"] += step_s
            times = phases.take()
            row = {"step": state.global_step, "step_s": step_s, **times}
            row["cpu_s"] = time.process_time() - self.cpu
            row["score_other"] = (
                times.get("prepare", 0) - times.get("gen", 0) - times.get("reward", 0)
            )
            row["update"] = step_s - times.get("prepare", 0)
            record["steps"].append(row)
            if args.eval_every and state.global_step % args.eval_every == 0:
                control.should_training_stop |= self._evaluate(state, model)
            if args.budget_s and record["training_time_s"] >= args.budget_s:
                control.should_training_stop = True
                record["stopped_by"] = record["stopped_by"] or "budget spent"
            self.mark, self.cpu = time.perf_counter(), time.process_time()

        def on_train_end(self, _args, state, control, model=None, **_):
            """A last evaluation when the run stopped between two (budget, max_steps)."""
            if record["evals"] and record["evals"][-1][0] != state.global_step:
                self._evaluate(state, model)

        def on_log(self, _args, state, control, logs=None, **_):
            if logs and "reward" in logs:
                record["reward"].append([state.global_step, logs["reward"]])

        def _evaluate(self, state, model) -> bool:
            if not args.eval_every:
                return False
            accuracy = greedy_accuracy(model, tokenizer, test, args.max_tokens)
            record["evals"].append([state.global_step, record["training_time_s"], accuracy])
            common.progress(f"trl step {state.global_step}: held-out {accuracy:.3f}")
            reached = accuracy >= args.target
            if reached and record["time_to_target_s"] is None:
                record["time_to_target_s"] = record["training_time_s"]
                record["stopped_by"] = "target reached"
            return reached

    return Clock()


def build_trainer(args: argparse.Namespace, record: dict):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback
    from trl import GRPOTrainer

    from rlfleet.common.config import load_config
    from rlfleet.model.model_io import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(common.MODEL_DIR)
    prefix = prompt_prefix(tokenizer)
    train = read_problems(TRAIN_DATA)
    rows = [{"prompt": prefix + p, "ground_truth": g} for p, g in train]
    # The attention kernel of rlfleet's default job, so both sides run the same model code.
    attn = load_config(common.REPO / "configs" / "default.yaml", []).model.attn_implementation
    kernel = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(str(common.MODEL_DIR), dtype="float32", **kernel)
    record["attn_implementation"] = attn or "default"
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arith_reward,
        args=grpo_config(args),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    ids = trainer._tokenize_prompts([rows[0]["prompt"]])[0][0]
    if list(ids) != encode_prompt(tokenizer, train[0][0]):
        raise RuntimeError(
            f"TRL feeds {list(ids)}, rlfleet {encode_prompt(tokenizer, train[0][0])}"
        )
    trainer.remove_callback(PrinterCallback)  # the harness reads the JSON, not stdout
    record["prompt_prefix"] = prefix
    record["prompt_ids_example"] = list(ids)
    test = read_problems(common.TEST_DATA)
    trainer.add_callback(step_callback(args, tokenizer, test, PhaseTimer(trainer), record))
    return trainer


def launch(flags: dict, out: Path, timeout_s: float) -> dict:
    """Run this script as a child process; its JSON record plus CPU seconds and machine load.

    The child gets its own session so a timeout can stop it and anything it started."""
    import signal
    import subprocess

    argv = [sys.executable, __file__, "--out", str(out), "--work-dir", str(out.parent / out.stem)]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    load_before = common.load_avg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    with (out.parent / f"{out.stem}.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=CHILD_ENV, start_new_session=True
        )
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # timeout or Ctrl-C: its own session does not get the terminal's SIGINT
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    record = json.loads(out.read_text()) if out.is_file() else {"steps": []}
    if proc.returncode != 0:
        record["error"] = f"e2e_trl.py exited {proc.returncode}: see {out.parent / out.stem}.log"
    record["load_avg"] = {"before": load_before, "after": common.load_avg()}
    record["omp_wait_policy"] = CHILD_ENV["OMP_WAIT_POLICY"]
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    record = {
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "steps": [],
        "reward": [],
        "evals": [],
        "training_time_s": 0.0,
        "time_to_target_s": None,
        "stopped_by": None,
    }
    started = time.perf_counter()
    trainer = build_trainer(args, record)
    trainer.train()
    record["wall_time_s"] = time.perf_counter() - started
    record["stopped_by"] = record["stopped_by"] or "finished"
    record["cpu_s_total"] = {"trl": time.process_time()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
