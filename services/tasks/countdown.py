"""Countdown: reach a target with arithmetic on given numbers, each used exactly once.

Why: a task a 135M instruct model can learn with RL on a CPU in minutes-to-hours, whose answer
is checked exactly (no model judge, no string match): the response must contain an
expression that uses exactly the given numbers (as a multiset: each once, none left out, none
added) and whose value equals the target. The problems come from ``reasoning-gym``
(``scripts/prepare_data.py``); the check is here, pure Python, so the reward service needs
neither reasoning-gym nor sympy. The ground truth has TinyZero's shape,
``{"target": int, "numbers": [int, ...]}`` (dict or its JSON text).

The expression is read with ``ast`` and only numbers, ``+ - * /``, unary minus and
parentheses are allowed; values are exact fractions, so ``6/4*2`` is exactly 3 and a division
by zero is simply wrong. The answer is the content of the last ``<answer>...</answer>`` when
there is one, else the response; within it, the last run of arithmetic characters that parses
(so a trailing ``= 309`` or a sentence around the expression does not hide it).
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

DATA_SOURCE = "countdown"
MAX_EXPRESSION_CHARS = 256  # longer runs are not read: a countdown answer is short
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_RUN = re.compile(r"[\d\s+\-*/().×÷]+")
_OPS = {
    ast.Add: Fraction.__add__,
    ast.Sub: Fraction.__sub__,
    ast.Mult: Fraction.__mul__,
    ast.Div: Fraction.__truediv__,
}
INSTRUCTION = (
    "Use the numbers {numbers} to make {target}. Use each number exactly once, with + - * / "
    "and parentheses. Show your work briefly, then give only the expression inside "
    "<answer> </answer>, for example <answer>(1 + 2) * 3</answer>."
)


@dataclass(frozen=True)
class Check:
    """What the response's answer was found to be."""

    expression: str | None  # the expression read, None when there was none
    uses_numbers: bool  # exactly the given numbers, each once
    correct: bool  # uses the numbers and equals the target


def prompt(numbers: list[int], target: int) -> str:
    return INSTRUCTION.format(numbers=", ".join(map(str, numbers)), target=target)


def ground_truth(numbers: list[int], target: int) -> dict:
    return {"target": int(target), "numbers": [int(n) for n in numbers]}


def parse_truth(truth: Any) -> tuple[list[int], int]:
    """(numbers, target) of a ground truth dict or its JSON text; ValueError otherwise."""
    value = json.loads(truth) if isinstance(truth, str) else truth
    if not isinstance(value, dict) or "target" not in value or "numbers" not in value:
        raise ValueError("countdown ground truth must be {'target': int, 'numbers': [int, ...]}")
    # A proto Value carries numbers as doubles: 61.0 is the integer 61.
    return [_integer(n) for n in value["numbers"]], _integer(value["target"])


def _integer(value: Any) -> int:
    number = Fraction(str(value))
    if number.denominator != 1:
        raise ValueError(f"countdown numbers are integers, got {value!r}")
    return int(number)


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, the integer literals used) of an arithmetic expression; None when it is
    not one (other syntax, non-integer literals, division by zero)."""
    text = expression.replace("×", "*").replace("÷", "/").strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval")
        literals: list[int] = []
        return _value(tree.body, literals), literals
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _value(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, literals), _value(node.right, literals))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand, literals)
        return -inner if isinstance(node.op, ast.USub) else inner
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


def answer_text(response: str) -> str:
    """The last ``<answer>`` block's content, else the whole response."""
    tagged = _ANSWER_TAG.findall(response)
    return tagged[-1] if tagged else response


def find_expression(response: str) -> tuple[str, Fraction, list[int]] | None:
    """The last run of arithmetic characters in the answer that is an expression of two or
    more numbers, else the last lone number: in ``94*4 - 61 - 6 = 309`` the answer is the
    left side, not the target after the ``=``."""
    found = [
        (candidate, *value)
        for candidate in (
            run.strip().rstrip(".").strip() for run in _RUN.findall(answer_text(response))
        )
        if any(ch.isdigit() for ch in candidate) and (value := evaluate(candidate)) is not None
    ]
    compound = [item for item in found if len(item[2]) > 1]
    return (compound or found)[-1] if found else None


def check(response: str, numbers: list[int], target: int) -> Check:
    found = find_expression(response)
    if found is None:
        return Check(None, False, False)
    expression, value, used = found
    uses = Counter(used) == Counter(numbers)
    return Check(expression, uses, uses and value == target)
