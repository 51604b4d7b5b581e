"""A reward file written for verl (its custom_reward_function), used unchanged by rlfleet tests.

It mirrors verl's own ``gsm8k.compute_score`` conventions, plus the batch form of verl's
BatchRewardManager and an ``async def`` variant; nothing here knows about rlfleet.
"""

import asyncio
import re


def extract_solution(solution_str, method="strict"):
    assert method in ["strict", "flexible"]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        return solutions[-1].replace(",", "").replace("$", "") if solutions else None
    answers = [a for a in re.findall("(\\-?[0-9\\.\\,]+)", solution_str) if a not in ("", ".")]
    return answers[-1] if answers else None


def compute_score(
    data_source,
    solution_str,
    ground_truth,
    extra_info=None,
    method="strict",
    format_score=0.0,
    score=1.0,
    **kwargs,
):
    """verl's gsm8k rule, returning a dict with extra metrics."""
    if isinstance(ground_truth, dict):  # verl datasets may keep structured ground truths
        ground_truth = ground_truth["answer"]
    answer = extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return {"score": 0.0, "found": False}
    correct = answer == str(ground_truth)
    return {"score": score if correct else format_score, "found": True, "pred": answer}


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    """verl's BatchRewardManager form: lists in, a list out."""
    return [
        compute_score(d, s, g, e, **kwargs)
        for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)
    ]


async def compute_score_async(
    data_source, solution_str, ground_truth, extra_info=None, prompt=None
):
    """An async function that also wants the prompt."""
    await asyncio.sleep(0)
    return float(solution_str.strip() == str(ground_truth)) + (0.5 if prompt else 0.0)


def kinds(data_source, solution_str, ground_truth, extra_info=None):
    """Reports the Python type the ground truth arrived as."""
    return {
        "score": 1.0,
        "is_dict": isinstance(ground_truth, dict),
        "is_list": isinstance(ground_truth, list),
        "is_int": isinstance(ground_truth, int),
    }
