"""GSM-Symbolic: grade-school word problems from GSM8K's templates, with fresh numbers.

Why: GSM8K itself is on the Hugging Face Hub (not reachable offline); ``reasoning-gym``
generates problems from the GSM-Symbolic templates (Mirzadeh et al., 2024, "GSM-Symbolic:
Understanding the Limitations of Mathematical Reasoning in Large Language Models") with exact
integer answers, offline and from a seed (``scripts/prepare_data.py``). The prompt asks for
the answer after ``####`` as GSM8K's solutions write it; the check is numeric and forgiving
about the form (``#### 1,250``, ``#### $42``, ``42.0``), and falls back to the last number of
the response when no ``####`` was written, so a small model that answers in plain words is
still scored on what it said.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

DATA_SOURCE = "gsm_symbolic"
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
"""Appended to the question: verl's GSM8K instruction, word for word."""
_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?"
_MARKED = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)


@dataclass(frozen=True)
class Check:
    answer: Fraction | None  # the number read, None when there was none
    marked: bool  # it came after '####'
    correct: bool


def prompt(question: str) -> str:
    return question.strip() + INSTRUCTION


def to_number(text: Any) -> Fraction | None:
    """``text`` as an exact number, ignoring ``,``, ``$`` and spaces; None if not one."""
    cleaned = re.sub(r"[,$\s]", "", str(text))
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def check(response: str, ground_truth: Any) -> Check:
    """The number after the last ``####``, else the last number, against ``ground_truth``."""
    return check_final_number(response, ground_truth, _MARKED, _ANY)


def check_final_number(
    response: str, ground_truth: Any, marked_pattern: re.Pattern, any_pattern: re.Pattern
) -> Check:
    """The last ``marked_pattern`` match (its group), else the last ``any_pattern`` match,
    compared exactly with ``ground_truth`` as numbers."""
    marked = marked_pattern.findall(response)
    found = marked or any_pattern.findall(response)
    answer = to_number(found[-1]) if found else None
    expected = to_number(ground_truth)
    correct = answer is not None and expected is not None and answer == expected
    return Check(answer, bool(marked), correct)
