"""An example user reward function for rlfleet (and verl: the signature is the same).

Point the reward service at it with::

    rlfleet reward reward.custom.path=examples/custom_reward.py \
        reward.custom.reward_kwargs='{tolerance: 0.01, format_bonus: 0.1}'

It scores numeric answers GSM8K-style: the answer is the number after ``####`` if the response
has one, else the last number in the response. Returning a dict shows how extra numbers become
metrics (``acc``, ``formatted``); non-numeric entries (``pred`` when nothing was found) are
ignored. A ground truth that is not a number raises ``ValueError``: the reward service reports
that as the item's error and keeps scoring the rest of the batch.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_MARKED = re.compile(r"####\s*([-+]?\d+(?:\.\d+)?)")


def extract_answer(solution_str: str) -> float | None:
    """The marked answer (after ``####``), else the last number, else None."""
    marked = _MARKED.search(solution_str)
    if marked:
        return float(marked.group(1))
    numbers = _NUMBER.findall(solution_str.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    tolerance: float = 0.0,
    format_bonus: float = 0.0,
) -> dict:
    """Numeric answer within ``tolerance`` of the ground truth scores 1, plus a format bonus."""
    target = float(ground_truth)  # raises ValueError for a non-numeric ground truth
    pred = extract_answer(solution_str)
    correct = pred is not None and abs(pred - target) <= tolerance
    formatted = _MARKED.search(solution_str) is not None
    score = float(correct) + (format_bonus if formatted else 0.0)
    return {"score": score, "acc": correct, "formatted": formatted, "pred": pred}
