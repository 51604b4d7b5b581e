"""verl's data-source names score exactly as verl's default reward does; rlfleet's own names
keep the better scorers. Cases: ``tests/data/verl_parity_cases.jsonl``, each with the score
verl 0.9.1's ``default_compute_score`` gives it (``scripts/check_verl_parity.py`` runs verl's
own ``gsm8k.py``/``math_reward.py`` on each case, and on 80,000 random ones) and the score of
the rlfleet scorer it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlfleet.common.config import RewardConfig
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.scorers.verl_parity import (
    GSM8K_SOURCES,
    MATH_SOURCES,
    gsm8k_strict_answer,
    last_boxed,
    normalise,
)
from rlfleet.reward.types import ScoreRequest

CASES = Path(__file__).resolve().parents[1] / "data" / "verl_parity_cases.jsonl"
ROWS = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
REGISTRY = build_registry(RewardConfig())


def score(data_source: str, response: str, truth, scorer: str | None = None) -> float:
    request = ScoreRequest("r", data_source, response, truth, {}, scorer=scorer)
    result = REGISTRY.select(request).score(request)
    assert result.error == ""
    return result.score


@pytest.mark.parametrize("row", ROWS, ids=[r["why"] for r in ROWS])
def test_verl_names_score_as_verl_does(row):
    assert score(row["data_source"], row["response"], row["ground_truth"]) == row["verl"]


@pytest.mark.parametrize("row", ROWS, ids=[r["why"] for r in ROWS])
def test_rlfleet_names_keep_their_own_scorers(row):
    got = score(row["data_source"], row["response"], row["ground_truth"], row["rlfleet_scorer"])
    assert got == row["rlfleet"]


def test_the_issues_cases_differ_as_measured():
    """The differences the issue names: 0 under verl's name, 1 under rlfleet's."""
    by_why = {r["why"]: r for r in ROWS}
    for why in [
        "no space after ####",
        "a dollar sign after '#### '",
        "the same number written 42.0",
        "the answer, then more than 300 characters",
        "a decimal for a fraction",
    ]:
        assert (by_why[why]["verl"], by_why[why]["rlfleet"]) == (0.0, 1.0), why


@pytest.mark.parametrize(
    ("source", "scorer"),
    [
        *((s, "verl_gsm8k") for s in GSM8K_SOURCES),
        *((s, "verl_math") for s in MATH_SOURCES),
        ("gsm8k", "gsm8k"),
        ("math", "math"),
        ("lighteval/MATH-Hard", "math"),
    ],
)
def test_selection_by_name(source, scorer):
    assert REGISTRY.select(ScoreRequest("r", source, "x")).name == scorer


def test_gsm8k_reads_only_the_last_300_characters():
    answer = "#### 42"
    assert gsm8k_strict_answer(answer + "x" * (300 - len(answer))) == "42"
    assert gsm8k_strict_answer(answer + "x" * (301 - len(answer))) is None
    assert gsm8k_strict_answer("#### 1,234,5") == "12345"  # commas go, digits stay as text


def test_a_non_string_ground_truth_never_matches_as_in_verl():
    assert score("openai/gsm8k", "#### 42", 42) == 0.0
    assert score("lighteval/MATH", "\\boxed{4}", 4) == 0.0
    assert score("lighteval/MATH", "\\boxed{4}", ["4"]) == 0.0


def test_math_normalisation_steps():
    assert normalise("\\left( 1, 2 \\right)") == "(1,2)"
    assert normalise("\\frac12") == normalise("\\frac{1}{2}") == "\\frac{1}{2}"
    assert normalise("\\frac1{72}") == "\\frac{1}{72}"
    assert normalise("\\sqrt3") == "\\sqrt{3}"
    assert normalise("5 \\text{ cm}") == "5"
    assert normalise("k = 7") == "7" and normalise("abc = 7") == "abc=7"
    assert normalise(".5") == "\\frac{1}{2}" and normalise("0.50") == "0.50"


def test_malformed_latex_falls_back_to_a_raw_compare():
    """verl's normalisation raises on these; it then compares the raw strings."""
    assert score("lighteval/MATH", "\\boxed{\\frac}", "\\frac") == 1.0
    assert score("lighteval/MATH", "\\boxed{\\sqrt}", " \\sqrt") == 0.0
    assert score("lighteval/MATH", "\\boxed{1 \\text{ a} \\text{ b}}", "1") == 0.0


def test_last_boxed_like_verl():
    assert last_boxed("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\boxed{\\frac{1}{\\sqrt{2}}}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert last_boxed("$\\boxed 12$ and more") == "\\boxed 12"
