"""Pulling the final answer out of a response, and deciding whether two answers agree.

GSM8K follows verl's ``gsm8k.py``: *strict* takes the number after the last ``####``,
*flexible* the last number anywhere; commas, ``$`` and trailing units are tolerated and the
comparison is numeric. MATH follows verl's ``math_reward.py``: the last ``\\boxed{...}`` is
the answer, and equivalence is decided by HuggingFace's ``math-verify`` (symbolic, so
``\\frac{1}{2}`` equals ``0.5``); without that package, by a normalised string compare.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

try:  # math-verify is a dependency; the fallback keeps scoring alive on a broken install
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify
except ImportError:  # pragma: no cover - depends on the environment
    _mv_parse = _mv_verify = None

HAS_MATH_VERIFY = _mv_verify is not None
# Its signal-based timeouts only work on the main thread; ours run in workers' threads under
# the service's per-item timeout, so they are off, and so is its warning about that, per call.
logging.getLogger("math_verify").setLevel(logging.ERROR)
_NUMBER = r"-?\$?\s*(?:\d[\d,]*)?\.?\d+"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)
_BOXED = ("\\boxed{", "\\fbox{")


def to_number(text: Any) -> float | None:
    """``text`` as a number, ignoring ``,`` ``$`` and spaces; None if it is not one."""
    cleaned = re.sub(r"[,$\s]", "", str(text))
    try:
        return float(cleaned)
    except ValueError:
        return None


def gsm8k_answer(solution: str, mode: Literal["strict", "flexible"] = "strict") -> float | None:
    """The final number: after the last ``####`` (strict) or the last one anywhere."""
    found = _STRICT.findall(solution) if mode == "strict" else _ANY_NUMBER.findall(solution)
    numbers = [n for n in (to_number(f) for f in found) if n is not None]
    return numbers[-1] if numbers else None


def gsm8k_correct(solution: str, ground_truth: Any, mode: Literal["strict", "flexible"]) -> bool:
    answer, expected = gsm8k_answer(solution, mode), to_number(ground_truth)
    return answer is not None and expected is not None and abs(answer - expected) < 1e-6


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind(marker) for marker in _BOXED)
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for index in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[opening + 1 : index]
    return None


def normalise(answer: str) -> str:
    """A plain form for string comparison: no spaces, ``\\left``/``\\right``, ``\\text{}``
    wrappers, ``$``, degree marks or trailing dot; ``dfrac``/``tfrac`` read as ``frac``."""
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", str(answer))
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("dfrac", "frac"),
        ("tfrac", "frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("$", ""),
    ):
        text = text.replace(old, new)
    text = re.sub(r"\s+", "", text).rstrip(".")
    number = to_number(text)
    return f"{number:g}" if number is not None else text


def math_equal(answer: str, ground_truth: Any) -> bool:
    """Whether a boxed answer equals the ground truth (math-verify, else normalised text)."""
    truth = str(ground_truth)
    if normalise(answer) == normalise(truth):
        return True
    if not HAS_MATH_VERIFY:
        return False
    gold = _mv_parse("\\boxed{" + truth + "}", parsing_timeout=None)
    pred = _mv_parse("\\boxed{" + answer + "}", parsing_timeout=None)
    return bool(gold and pred and _mv_verify(gold, pred, timeout_seconds=None))
