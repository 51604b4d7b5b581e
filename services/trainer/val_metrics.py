"""Validation metrics when each held-out prompt is sampled ``n`` times (verl's names).

``mean@n`` is the mean score of all samples, ``best@n`` the mean over prompts of each prompt's
best score (pass@n for a 0/1 scorer), and ``maj@n`` the mean over prompts of the score of the
majority answer (self-consistency, Wang et al. 2022, arXiv:2203.11171). verl estimates the
``@k`` numbers by bootstrap over subsets; with all ``n`` samples there is one subset, so these
are exact and need no randomness.

The answer a sample votes for is the scorer's extracted answer when it reports one (a numeric
``pred`` metric, verl's key), else the response text with surrounding whitespace stripped.
Ties go to the answer seen first. Pure functions over plain lists: no torch, no I/O.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

PRED_KEY = "pred"
"""The score metric holding a scorer's extracted answer (verl's ``reward_extra_info['pred']``)."""


def answer_of(text: str, score_metrics: Mapping[str, float] | None = None) -> str:
    """What a sample votes for: the scorer's ``pred`` if given, else the stripped text."""
    if score_metrics and PRED_KEY in score_metrics:
        return repr(float(score_metrics[PRED_KEY]))
    return text.strip()


def majority_score(scores: Sequence[float], answers: Sequence[str]) -> float:
    """The score of the most frequent answer (ties: the one seen first; its first sample's
    score). ``scores`` and ``answers``: one entry per sample of one prompt."""
    if not scores or len(scores) != len(answers):
        raise ValueError(f"need as many answers as scores, got {len(answers)} and {len(scores)}")
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)  # first seen among the tied
    return float(scores[answers.index(winner)])


def group_metrics(scores: Sequence[float], answers: Sequence[str]) -> tuple[float, float, float]:
    """``(mean, best, majority)`` of one prompt's samples."""
    mean = sum(scores) / len(scores) if scores else 0.0
    return mean, float(max(scores)), majority_score(scores, answers)


def sampled_metrics(
    sources: Sequence[str],
    scores: Sequence[Sequence[float]],
    answers: Sequence[Sequence[str]],
) -> dict[str, float]:
    """``val-core/<data_source>/reward/{mean,best,maj}@n`` per data source.

    ``sources[i]`` is prompt i's data source, ``scores[i]``/``answers[i]`` its ``n`` samples
    (every prompt the same ``n``). ``mean@n`` averages over all samples (equal to the mean of
    the per-prompt means, since every prompt has ``n``)."""
    sizes = {len(row) for row in scores}
    if len(sizes) != 1 or len(sources) != len(scores) or len(scores) != len(answers):
        raise ValueError("every prompt needs the same number n >= 1 of scores and answers")
    n = sizes.pop()
    per_source: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for source, row, votes in zip(sources, scores, answers, strict=True):
        per_source[source].append(group_metrics(row, votes))
    metrics: dict[str, float] = {}
    for source, rows in per_source.items():
        for index, name in enumerate(("mean", "best", "maj")):
            metrics[f"val-core/{source}/reward/{name}@{n}"] = sum(r[index] for r in rows) / len(
                rows
            )
    return metrics
