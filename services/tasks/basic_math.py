"""Basic math: easy arithmetic and counting families a 135M model gets right some of the time.

Why: GRPO learns only from groups whose samples disagree. On SmolLM2-135M-Instruct countdown
and GSM-Symbolic give almost every group all-zero rewards (no signal), while one-step
arithmetic, sums of a few small numbers, comparisons and counting questions are answered right
often enough to learn from and wrong often enough to gain (measured 2026-12-04: greedy 0.03-0.66
per family, mixed results in 9-62% of the prompts at temperature 1). The problems come from
``reasoning-gym`` (its ``basic_arithmetic``, ``chain_sum``, ``leg_counting`` and
``letter_counting`` generators, with their difficulty knobs) plus a number comparison written
here; ``scripts/prepare_data.py --tasks basic_math`` writes them as verl-schema Parquet.

Each row's ``data_source`` is its family, so the built-in ``basic_math`` scorer is picked by
name and held-out accuracy is reported per family (``val-core/<family>/reward/mean@1``). Every
answer is an integer; the check reads the number after the last ``Answer:`` when the response
has one, else its last number (so a model that answers in a sentence is scored on what it
said), and compares it exactly with the ground truth.
"""

from __future__ import annotations

import re
from typing import Any

from rlfleet.tasks.gsm_symbolic import Check, check_final_number

INSTRUCTION = " Reply with the final answer as a number on the last line, as 'Answer: N'."
"""Appended to every question: asks for the answer last, in one checkable form."""

FAMILIES: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ("+", "-", "*"),
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {
        "min_terms": 3,
        "max_terms": 3,
        "min_digits": 1,
        "max_digits": 1,
        "allow_negation": False,
    },
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 3},
    "letter_counting": {"min_words": 3, "max_words": 6},
    "number_comparison": {"min_value": 1, "max_value": 99},
}
"""Each family's difficulty: reasoning-gym's generator settings (``number_comparison``: the
range of the two numbers). Easier than reasoning-gym's defaults, so that the model starts
between the floor and the ceiling."""

DATA_SOURCES = tuple(FAMILIES)
_MARKED = re.compile(r"answer\s*(?:is)?\s*[:=]?\s*\**\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_ANY = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def prompt(question: str) -> str:
    return question.strip() + INSTRUCTION


def check(response: str, ground_truth: Any) -> Check:
    """The number after the last ``Answer:``, else the last number, against ``ground_truth``."""
    return check_final_number(response, ground_truth, _MARKED, _ANY)


def comparison_question(first: int, second: int) -> tuple[str, int]:
    """A "which is larger" question and its answer (the two numbers differ)."""
    if first == second:
        raise ValueError(f"the two numbers must differ, got {first} twice")
    return f"Which number is larger, {first} or {second}?", max(first, second)
