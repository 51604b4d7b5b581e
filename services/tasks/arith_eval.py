"""Greedy accuracy of a local model on arithmetic problems (the model build script's check
and the tiny model's tests).

Why here and not in ``rlfleet.model.model_io``: the model layer knows nothing of tasks; scoring
a task's answers is the task's business, and it only borrows the model layer's generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlfleet.model.model_io import greedy_completions
from rlfleet.tasks.arith import Problem, parse_answer


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    max_new_tokens: int = 4,
    batch_size: int = 256,
) -> float:
    """Fraction of `problems` whose greedy completion starts with the right sum."""
    if not problems:
        return 0.0
    completions = greedy_completions(
        model, tokenizer, [p.prompt for p in problems], max_new_tokens, batch_size
    )
    hits = sum(
        parse_answer(text) == int(p.answer) for text, p in zip(completions, problems, strict=True)
    )
    return hits / len(problems)
