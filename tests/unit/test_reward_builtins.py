"""Built-in scorers on small hand-made cases, verl data_source names, and the HTTP compat
shapes (OpenRLHF, slime) as plain functions."""

from __future__ import annotations

import pytest

from rlfleet.common.config import RewardConfig
from rlfleet.common.errors import InvalidArgument
from rlfleet.reward import compat
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.scorers.answers import HAS_MATH_VERIFY, last_boxed, normalise
from rlfleet.reward.types import ScoreRequest, ScoreResult

REGISTRY = build_registry(RewardConfig())


def score(scorer: str, response: str, truth: object = "", **extra) -> float:
    request = ScoreRequest("r", "", response, truth, extra, scorer=scorer)
    result = REGISTRY.select(request).score(request)
    assert result.error == ""
    return result.score


@pytest.mark.parametrize(
    ("response", "truth", "strict", "flexible"),
    [
        ("3 + 4 = 7 #### 7", "7", 1.0, 1.0),
        ("so #### $1,250 dollars", "1250", 1.0, 1.0),
        ("#### 1,250.00", "1,250", 1.0, 1.0),
        ("the answer is 72", "72", 0.0, 1.0),  # no '####': only flexible finds it
        ("#### 8 then 9", "8", 1.0, 0.0),
        ("#### -3", "-3", 1.0, 1.0),
        ("no number", "3", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    assert (score("gsm8k", response, truth), score("gsm8k_flexible", response, truth)) == (
        strict,
        flexible,
    )


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("so \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac12", 1.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("\\boxed{x^{2}}", "x^2", 1.0),
        ("the answer is 4", "4", 0.0),  # not boxed
        ("\\boxed{5}", "4", 0.0),
        ("\\boxed{6}", ["4", "6"], 1.0),  # a list of accepted answers
    ],
)
def test_math_boxed_answers(response, truth, expected):
    assert score("math", response, truth) == expected


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="needs math-verify")
def test_math_is_symbolic_with_math_verify():
    assert score("math", "\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
    assert score("math", "\\boxed{\\{1,2\\}}", "\\{2,1\\}") == 1.0


def test_answer_helpers():
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert normalise(" \\left( 1,2 \\right). ") == "(1,2)" and normalise("1,000") == "1000"


def test_exact_match_regex_format_and_composite():
    assert score("exact_match", "  Paris \n", "Paris") == 1.0
    assert score("exact_match", "paris", "Paris") == 0.0
    assert score("exact_match", "Lyon", ["Paris", "Lyon"]) == 1.0
    assert score("regex", "Final: 42.", r"Final:\s*42\b") == 1.0
    assert score("regex", "Final: 421", r"Final:\s*42\b") == 0.0
    well_formed = "<think>2+2</think> <answer>\\boxed{4}</answer>"
    assert score("format", well_formed) == 1.0
    assert score("format", "<answer>4</answer>") == 0.0
    assert score("format", "ANSWER: 4", format=r"ANSWER: \d+") == 1.0
    assert score("composite", well_formed, "4") == pytest.approx(1.0)
    assert score("composite", "\\boxed{4}", "4") == pytest.approx(0.9)
    assert score("composite", "<think>a</think><answer>5</answer>", "4") == pytest.approx(0.1)


def test_composite_weights_come_from_config_and_are_checked():
    registry = build_registry(RewardConfig(composite={"exact_match": 2.0, "regex": 1.0}))
    request = ScoreRequest("r", "", "abc", "abc", scorer="composite")
    result = registry.select(request).score(request)
    assert (result.score, result.metrics) == (3.0, {"exact_match": 1.0, "regex": 1.0})
    with pytest.raises(ValueError, match="unknown scorers \\['nope'\\]"):
        build_registry(RewardConfig(composite={"nope": 1.0}))


@pytest.mark.parametrize(
    ("source", "scorer"),
    [
        ("openai/gsm8k", "verl_gsm8k"),  # verl's names score as verl does (test_verl_parity)
        ("lighteval/MATH", "verl_math"),
        ("DigitalLearningGmbH/MATH-lighteval", "verl_math"),
        ("HuggingFaceH4/MATH-500", "verl_math"),
        ("arith", "arith"),
    ],
)
def test_verl_data_sources_select_builtins_without_config(source, scorer):
    assert REGISTRY.select(ScoreRequest("r", source, "x")).name == scorer


def test_openrlhf_shapes():
    body = {
        "query": ["Q: 1+1? A: \\boxed{2}", "\\boxed{3}"],
        "prompts": ["Q: 1+1? A:", ""],
        "labels": ["2", "4"],
    }
    requests = compat.openrlhf_requests(body, "math")
    assert [(r.id, r.solution_str, r.scorer, r.prompt) for r in requests] == [
        ("0", " \\boxed{2}", "math", "Q: 1+1? A:"),
        ("1", "\\boxed{3}", "math", ""),
    ]
    results = [ScoreResult("0", 1.0, {"acc": 1.0}), ScoreResult("1", error="boom")]
    assert compat.openrlhf_reply(results) == {
        "rewards": [1.0, 0.0],
        "scores": [1.0, 0.0],
        "extra_logs": {"acc": [1.0, 0.0], "reward_error": [0.0, 1.0]},
    }
    with pytest.raises(InvalidArgument, match="equally long"):
        compat.openrlhf_requests({"query": ["a"], "labels": []}, "math")
    with pytest.raises(InvalidArgument, match="unknown fields"):
        compat.openrlhf_requests({"query": [], "extra": 1}, "math")


def test_slime_shapes():
    request = compat.slime_request({"prompt": "p", "response": "r", "label": {"a": 1}}, "math")
    assert (request.solution_str, request.ground_truth, request.scorer) == ("r", {"a": 1}, "math")
    sourced = compat.slime_request({"response": "r", "data_source": "openai/gsm8k"}, "math")
    assert (sourced.scorer, sourced.data_source) == (None, "openai/gsm8k")
    result = ScoreResult("0", 0.5, {"acc": 0.0})
    assert compat.slime_reply(result, False) == 0.5
    assert compat.slime_reply(result, True) == {"score": 0.5, "metrics": {"acc": 0.0}}
    with pytest.raises(InvalidArgument, match="string 'response'"):
        compat.slime_request({"prompt": "p"}, "math")
