"""The scorers that ship with rlfleet, and the verl dataset names that select them.

verl picks its built-in scorer from ``data_source`` (``openai/gsm8k`` -> gsm8k,
``lighteval/MATH`` and friends -> math); the same names select scorers that score exactly as
verl's do (``verl_gsm8k``, ``verl_math``: ``verl_parity``), so a verl recipe trains on the
reward it trained on there, without configuration. rlfleet's own, more forgiving ones keep
their names (``gsm8k``, ``gsm8k_flexible``, ``math``: math-verify). Those verl names are
*aliases*: a user function configured as the default takes them over, as verl's
``custom_reward_function`` does. The tasks of ``scripts/prepare_data.py`` claim their data
sources outright (``countdown``, ``gsm_symbolic``, the ``basic_math`` families; HumanEval goes
to ``code``). Each function has verl's keyword signature, and a ground truth may be a list of
accepted answers where text is expected (not under verl's names: verl compares one string).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rlfleet.reward.scorers import answers, verl_parity
from rlfleet.reward.scorers.base import ScoreFn, Scorer, to_result
from rlfleet.tasks import arith, basic_math, countdown, gsm_symbolic

GSM8K_SOURCES = ["gsm8k"]
MATH_SOURCES = ["lighteval/MATH-Hard", "math"]  # names verl's default does not score
THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


def _accepted(ground_truth: Any) -> list[Any]:
    """The accepted answers: a list as given, anything else as the only one."""
    return list(ground_truth) if isinstance(ground_truth, list | tuple) else [ground_truth]


def arith_score(solution_str: str, ground_truth: Any, **_: Any) -> float:
    return arith.score(solution_str, str(ground_truth))


def gsm8k_score(solution_str: str, ground_truth: Any, mode: str = "strict", **_: Any) -> dict:
    found = answers.gsm8k_answer(solution_str, mode)  # type: ignore[arg-type]
    correct = any(answers.gsm8k_correct(solution_str, t, mode) for t in _accepted(ground_truth))  # type: ignore[arg-type]
    return {"score": float(correct), "acc": float(correct), "extracted": float(found is not None)}


def gsm8k_flexible_score(solution_str: str, ground_truth: Any, **_: Any) -> dict:
    return gsm8k_score(solution_str, ground_truth, mode="flexible")


def math_score(solution_str: str, ground_truth: Any, **_: Any) -> dict:
    boxed = answers.last_boxed(solution_str)
    correct = boxed is not None and any(
        answers.math_equal(boxed, t) for t in _accepted(ground_truth)
    )
    return {"score": float(correct), "acc": float(correct), "boxed": float(boxed is not None)}


def countdown_score(solution_str: str, ground_truth: Any, **_: Any) -> dict:
    """1.0 when the answer uses exactly the given numbers and equals the target."""
    numbers, target = countdown.parse_truth(ground_truth)
    found = countdown.check(solution_str, numbers, target)
    return {
        "score": float(found.correct),
        "acc": float(found.correct),
        "expression": float(found.expression is not None),
        "uses_numbers": float(found.uses_numbers),
    }


def gsm_symbolic_score(solution_str: str, ground_truth: Any, **_: Any) -> dict:
    return _final_number_result(gsm_symbolic.check(solution_str, ground_truth))


def basic_math_score(solution_str: str, ground_truth: Any, **_: Any) -> dict:
    return _final_number_result(basic_math.check(solution_str, ground_truth))


def _final_number_result(found: gsm_symbolic.Check) -> dict:
    """A final-number task's score and metrics: correct, an answer found, and marked."""
    return {
        "score": float(found.correct),
        "acc": float(found.correct),
        "extracted": float(found.answer is not None),
        "marked": float(found.marked),
    }


def exact_match_score(solution_str: str, ground_truth: Any, **_: Any) -> float:
    """1.0 when the response, trimmed and with runs of spaces collapsed, is an accepted answer."""
    said = " ".join(solution_str.split())
    return float(any(said == " ".join(str(t).split()) for t in _accepted(ground_truth)))


def regex_score(solution_str: str, ground_truth: Any, **_: Any) -> float:
    """1.0 when the ground truth, a regular expression, is found in the response."""
    return float(re.search(str(ground_truth), solution_str, re.DOTALL) is not None)


def format_score(solution_str: str, extra_info: Mapping | None = None, **_: Any) -> float:
    """1.0 when the response has the required structure: ``extra_info["format"]`` (a regular
    expression matched against the whole response) or ``<think>...</think><answer>...</answer>``."""
    pattern = (extra_info or {}).get("format") or THINK_ANSWER
    return float(re.fullmatch(pattern, solution_str, re.DOTALL) is not None)


def composite(weights: Mapping[str, float], parts: Mapping[str, Scorer]) -> ScoreFn:
    """A function scoring sum(weight * part score); each part's score is also a metric."""

    def score(**kwargs: Any) -> dict[str, float]:
        values = {name: _part_score(parts[name], kwargs) for name in weights}
        total = sum(weights[name] * value for name, value in values.items())
        return {"score": total, **values}

    return score


def _part_score(part: Scorer, arguments: dict[str, Any]) -> float:
    result = to_result("", part.fn(**arguments, **part.kwargs), part.name)
    if result.error:
        raise ValueError(result.error)
    return result.score


def _builtin(name: str, fn: ScoreFn, description: str, **extra: Any) -> Scorer:
    return Scorer(
        name=name,
        kind="builtin",
        fn=fn,
        description=description,
        blocking=extra.pop("blocking", False),
        **extra,
    )


def builtin_scorers(weights: Mapping[str, float]) -> list[Scorer]:
    """Pure Python and fast, so they run inline in a worker; ``math`` (sympy) in a thread."""
    scorers = [
        _builtin(
            "arith",
            arith_score,
            "1.0 if the response starts with the integer ground truth",
            data_sources=[arith.DATA_SOURCE],
        ),
        _builtin(
            "gsm8k",
            gsm8k_score,
            "the number after '####' equals the ground truth (strict)",
            aliases=GSM8K_SOURCES,
        ),
        _builtin("gsm8k_flexible", gsm8k_flexible_score, "the last number equals the ground truth"),
        _builtin(
            "math",
            math_score,
            "the last \\boxed{} answer is equivalent (math-verify)",
            aliases=MATH_SOURCES,
            blocking=True,
        ),
        _builtin(
            "verl_gsm8k",
            verl_parity.verl_gsm8k_score,
            "verl's openai/gsm8k: '#### ' + the exact answer string in the last 300 chars",
            aliases=verl_parity.GSM8K_SOURCES,
        ),
        _builtin(
            "verl_math",
            verl_parity.verl_math_score,
            "verl's MATH: the last \\boxed{} answer, string-normalised, equals the truth",
            aliases=verl_parity.MATH_SOURCES,
        ),
        _builtin(
            "countdown",
            countdown_score,
            "the expression uses exactly the given numbers and equals the target",
            data_sources=[countdown.DATA_SOURCE],
        ),
        _builtin(
            "gsm_symbolic",
            gsm_symbolic_score,
            "the number after the last '####' (else the last number) equals the answer",
            data_sources=[gsm_symbolic.DATA_SOURCE],
        ),
        _builtin(
            "basic_math",
            basic_math_score,
            "the number after the last 'Answer:' (else the last number) equals the answer",
            data_sources=list(basic_math.DATA_SOURCES),
        ),
        _builtin("exact_match", exact_match_score, "the trimmed response equals the ground truth"),
        _builtin("regex", regex_score, "the ground truth (a regex) is found in the response"),
        _builtin("format", format_score, "the response has <think>..</think><answer>..</answer>"),
    ]
    return [*scorers, composite_scorer(weights, {s.name: s for s in scorers})]


def composite_scorer(weights: Mapping[str, float], known: Mapping[str, Scorer]) -> Scorer:
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ValueError(
            f"reward.composite names unknown scorers {unknown}; known: {sorted(known)}"
        )
    parts = {name: known[name] for name in weights}
    summary = " + ".join(f"{w:g}*{name}" for name, w in weights.items())
    blocking = any(part.blocking for part in parts.values())
    return _builtin("composite", composite(weights, parts), summary, blocking=blocking)
