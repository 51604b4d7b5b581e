"""verl compatibility: a reward file written for verl scores unchanged (tests/data), by keyword,
sync or async, single or batch form; ground truths keep their JSON type across proto and JSON."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlfleet.common.config import RewardConfig, UserScorerConfig
from rlfleet.reward.batch_scorer import BatchScorer
from rlfleet.reward.convert import request_from_proto, request_to_proto
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.types import ScoreRequest, decode_requests, encode_requests

VERL_FILE = Path(__file__).resolve().parents[1] / "data" / "verl_style_reward.py"


def engine(name: str, **kwargs) -> BatchScorer:
    custom = UserScorerConfig(path=str(VERL_FILE), name=name, reward_kwargs=kwargs)
    return BatchScorer(build_registry(RewardConfig(custom=custom)), item_timeout_s=30)


def items(*pairs, source: str = "openai/gsm8k") -> list[ScoreRequest]:
    return [ScoreRequest(str(i), source, s, t) for i, (s, t) in enumerate(pairs)]


CASES = (("so #### 72", "72"), ("#### 1,000", "1000"), ("72", "72"), ("#### 5", "6"))


@pytest.mark.parametrize("name", ["compute_score", "compute_score_batch"])
async def test_verl_file_scores_unchanged_in_single_and_batch_form(name):
    scorer = engine(name, method="strict", format_score=0.1)
    try:
        results = await scorer.score_all(items(*CASES))
    finally:
        scorer.close()
    assert [r.score for r in results] == [1.0, 1.0, 0.0, 0.1]
    assert results[0].metrics == {"found": 1.0}  # "pred" is text: not a metric
    assert results[2].metrics == {"found": 0.0}
    assert [r.id for r in results] == ["0", "1", "2", "3"]


async def test_user_default_takes_verl_names_over_builtins():
    """As verl's custom_reward_function does: 'openai/gsm8k' goes to the user function."""
    registry = build_registry(RewardConfig(custom=UserScorerConfig(path=str(VERL_FILE))))
    assert registry.select(items(("x", "1"))[0]).name == "compute_score"


async def test_async_function_gets_the_prompt_when_it_asks():
    scorer = engine("compute_score_async")
    request = ScoreRequest("a", "x", " 7 ", "7", prompt="What is 3+4?")
    try:
        with_prompt, without = await scorer.score_all([request, items(("7", "7"))[0]])
    finally:
        scorer.close()
    assert (with_prompt.score, without.score) == (1.5, 1.0)


@pytest.mark.parametrize(
    ("truth", "metric"), [({"answer": "72"}, "is_dict"), ([1, 2], "is_list"), (12, "is_int")]
)
async def test_ground_truth_reaches_the_function_as_its_json_type(truth, metric):
    request = ScoreRequest("a", "x", "#### 72", truth, {"index": 1})
    via_proto = request_from_proto(request_to_proto(request))
    via_json = decode_requests(encode_requests([request]))[0]
    assert via_proto.ground_truth == truth == via_json.ground_truth
    scorer = engine("kinds")
    try:
        result = await scorer.score(via_proto)
    finally:
        scorer.close()
    assert result.metrics[metric] == 1.0


async def test_dict_ground_truth_scores_through_the_verl_function():
    scorer = engine("compute_score")
    try:
        result = await scorer.score(ScoreRequest("a", "x", "#### 72", {"answer": "72"}))
    finally:
        scorer.close()
    assert result.score == 1.0


async def test_batch_function_returning_the_wrong_length_fails_its_items(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        "def f(data_sources, solution_strs, ground_truths, extra_infos):\n    return [1]\n"
    )
    custom = UserScorerConfig(path=str(path), name="f")
    scorer = BatchScorer(build_registry(RewardConfig(custom=custom)))
    try:
        results = await scorer.score_all(items(("1", "1"), ("2", "2"), source="x"))
    finally:
        scorer.close()
    assert all("returned 1 answers for 2 items" in r.error for r in results)
