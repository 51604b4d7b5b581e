"""The basic_math families' check (``rlfleet.tasks.basic_math``) and the built-in scorer their
data sources select: the number after the last ``Answer:``, else the last number, exactly."""

from __future__ import annotations

import pytest

from rlfleet.common.config import RewardConfig
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.types import ScoreRequest
from rlfleet.tasks import basic_math

REGISTRY = build_registry(RewardConfig())


@pytest.mark.parametrize(
    ("response", "correct", "marked"),
    [
        ("Answer: 42", True, True),
        ("6 * 7 = 42.\nAnswer: 42", True, True),
        ("First 40, then 2 more.\nAnswer: **42**", True, True),
        ("The answer is 42.", True, True),
        ("6 times 7 makes 42", True, False),  # no marker: the last number
        ("Answer: 41. Oh wait, 6 * 7 = 42", False, True),  # the marked number counts
        ("Answer: 1,042", False, True),
        ("I do not know", False, False),
        ("Answer: -42", False, True),
    ],
)
def test_check_reads_the_marked_number_else_the_last(response, correct, marked):
    found = basic_math.check(response, "42")
    assert (found.correct, found.marked) == (correct, marked)


def test_a_comma_grouped_answer_is_read_whole():
    assert basic_math.check("Answer: 1,042", 1042).correct


@pytest.mark.parametrize("family", basic_math.DATA_SOURCES)
def test_every_family_selects_the_basic_math_scorer(family):
    request = ScoreRequest("r", family, "so the total is 12\nAnswer: 12", "12", {})
    scorer = REGISTRY.select(request)
    [result] = scorer.score_many([request])
    assert scorer.name == "basic_math" and result.score == 1.0 and result.error == ""
    assert result.metrics["marked"] == 1.0
    [wrong] = scorer.score_many([ScoreRequest("w", family, "Answer: 13", "12", {})])
    assert wrong.score == 0.0


def test_comparison_question_and_its_answer():
    question, answer = basic_math.comparison_question(17, 71)
    assert question == "Which number is larger, 17 or 71?" and answer == 71
    with pytest.raises(ValueError, match="must differ"):
        basic_math.comparison_question(5, 5)


def test_prompt_asks_for_the_answer_last():
    assert basic_math.prompt(" What is 2 + 3? ").endswith("as 'Answer: N'.")
