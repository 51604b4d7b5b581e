"""Integer-addition problems: the task of the default job.

Why this module exists: the default job must run end to end on a laptop-class CPU in minutes,
so its task is tiny (two-digit addition), exactly checkable, and generated from a seed rather
than downloaded. Everything here is pure Python so the data script, the reward service and the
tests can share one definition of prompt, answer and score without importing torch.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

DATA_SOURCE = "arith"
_LEADING_INT = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class Problem:
    """One addition problem `a + b`; the prompt is what the model sees, the answer its target."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def all_pairs(digits: int) -> list[tuple[int, int]]:
    """Every (a, b) with both operands in 0 .. 10**digits - 1, in a fixed order."""
    top = 10**digits
    return [(a, b) for a in range(top) for b in range(top)]


def split_problems(
    seed: int, n_train: int, n_test: int, digits: int = 2
) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and test problem sets, the same for the same arguments.

    Sampling without replacement from the full pair space guarantees that no held-out pair is
    ever seen in training, so held-out accuracy measures generalisation, not memory.
    """
    pairs = all_pairs(digits)
    if n_train < 0 or n_test < 0 or n_train + n_test > len(pairs):
        raise ValueError(f"need 0 <= n_train + n_test <= {len(pairs)}, got {n_train}+{n_test}")
    chosen = random.Random(seed).sample(pairs, n_train + n_test)
    problems = [Problem(a, b) for a, b in chosen]
    return problems[:n_train], problems[n_train:]


def parse_answer(text: str) -> int | None:
    """The integer the completion starts with (after whitespace), or None if it starts otherwise.

    Only the leading integer counts, so trailing junk after a correct answer is tolerated but an
    answer buried later in the text is not.
    """
    match = _LEADING_INT.match(text.strip())
    return int(match.group()) if match else None


def score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the completion's leading integer equals the ground truth, else 0.0."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        return 0.0
    return 1.0 if parse_answer(solution_str) == expected else 0.0


def to_verl_record(p: Problem, split: str, index: int) -> dict:
    """One row in verl's dataset schema, so any verl-style loader or reward fn can read it."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": p.prompt}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {"split": split, "index": index},
    }


def from_verl_record(record: dict) -> Problem:
    """Recover the Problem from a verl record written by `to_verl_record`."""
    content = (
        record["prompt"][-1]["content"] if isinstance(record["prompt"], list) else record["prompt"]
    )
    left, right = content.rstrip("=").split("+")
    return Problem(int(left), int(right))
