"""Reward scorers, request validation and conversions: no servers, no Redis."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rlfleet.common.config import RewardConfig, UserScorerConfig
from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.reward.convert import request_from_proto, request_to_proto
from rlfleet.reward.score_cli import row_to_request
from rlfleet.reward.scorers import Scorer, ScorerRegistry, build_registry, load_user_function
from rlfleet.reward.types import MAX_TEXT_BYTES, ScoreRequest, ScoreResult, validate_batch
from rlfleet.reward.worker import RewardWorker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_reward.py"


def req(solution: str, truth: str = "42", source: str = "arith", **kw) -> ScoreRequest:
    return ScoreRequest(
        id="r1", data_source=source, solution_str=solution, ground_truth=truth, **kw
    )


def score(registry: ScorerRegistry, request: ScoreRequest) -> ScoreResult:
    return registry.select(request).score(request)


def custom_registry(**custom) -> ScorerRegistry:
    return build_registry(RewardConfig(custom=UserScorerConfig(path=str(EXAMPLE), **custom)))


def user_file(tmp_path: Path, body: str) -> UserScorerConfig:
    path = tmp_path / "user_reward.py"
    path.write_text(
        f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n{body}\n"
    )
    return UserScorerConfig(path=str(path))


# ---- built-in and selection ---------------------------------------------------------------


def test_arith_scores_leading_integer():
    registry = build_registry(RewardConfig())
    assert score(registry, req("42")) == ScoreResult(id="r1", score=1.0)
    assert score(registry, req(" 42<eos>junk")).score == 1.0
    assert score(registry, req("41")).score == 0.0
    assert score(registry, req("the answer is 42")).score == 0.0


def test_unknown_data_source_is_not_found_and_lists_known_ones():
    registry = build_registry(RewardConfig())
    with pytest.raises(NotFound, match=r"'nope'.*known data sources: \[.*'arith'.*'openai/gsm8k'"):
        registry.select(req("42", source="nope"))


def test_explicit_scorer_overrides_data_source():
    registry = custom_registry()
    assert registry.select(req("42", source="arith", scorer="compute_score")).kind == "user"
    with pytest.raises(NotFound, match="no scorer named 'nope'"):
        registry.select(req("42", scorer="nope"))


def test_user_function_is_default_only_without_data_sources():
    assert custom_registry().select(req("42", source="gsm8k")).name == "compute_score"
    assert custom_registry().select(req("42", source="arith")).name == "arith"
    claimed = custom_registry(data_sources=["gsm8k", "arith"])
    assert claimed.select(req("42", source="arith")).name == "compute_score"
    assert claimed.select(req("42", source="math")).name == "math"  # a verl alias, unclaimed
    with pytest.raises(NotFound):
        claimed.select(req("42", source="nope"))


def test_list_scorers_reports_kinds_and_sources():
    infos = {info.name: info for info in custom_registry().list_scorers()}
    assert infos["arith"].kind == "builtin" and infos["arith"].data_sources == ["arith"]
    assert infos["compute_score"].kind == "user" and infos["compute_score"].data_sources == ["*"]
    assert infos["compute_score"].description.startswith("Numeric answer")


# ---- user functions ------------------------------------------------------------------------


def test_user_function_gets_reward_kwargs():
    close = req("about 41.8", source="gsm8k")
    assert score(custom_registry(), close).score == 0.0
    assert score(custom_registry(reward_kwargs={"tolerance": 0.5}), close).score == 1.0


def test_dict_return_becomes_score_and_numeric_metrics():
    registry = custom_registry(reward_kwargs={"format_bonus": 0.25})
    result = score(registry, req("so #### 42", source="gsm8k"))
    assert result.score == 1.25 and result.error == ""
    assert result.metrics == {"acc": 1.0, "formatted": 1.0, "pred": 42.0}
    nothing = score(registry, req("no idea", source="gsm8k"))
    assert nothing.metrics == {"acc": 0.0, "formatted": 0.0}  # pred=None is not a metric


def test_raising_function_gives_item_error():
    result = score(custom_registry(), req("42", truth="forty-two", source="gsm8k"))
    assert result.score == 0.0
    assert "compute_score raised ValueError" in result.error


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("    return 'yes'", "returned str"),
        ("    return {'acc': 1.0}", "without 'score'"),
        ("    return float('nan')", "returned nan"),
        ("    return None", "returned NoneType"),
    ],
)
def test_non_number_return_gives_item_error(tmp_path, body, message):
    registry = build_registry(RewardConfig(custom=user_file(tmp_path, body)))
    result = score(registry, req("42", source="x"))
    assert message in result.error and result.score == 0.0


@pytest.mark.parametrize(
    ("body", "expected"),
    [("    return True", 1.0), ("    import numpy\n    return numpy.float32(0.5)", 0.5)],
)
def test_bool_and_numpy_returns_are_numbers(tmp_path, body, expected):
    registry = build_registry(RewardConfig(custom=user_file(tmp_path, body)))
    assert score(registry, req("42", source="x")).score == expected


def test_missing_file_or_function_fails_at_load(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_user_function(tmp_path / "absent.py", "compute_score")
    with pytest.raises(AttributeError, match="no function 'other'"):
        load_user_function(EXAMPLE, "other")


async def test_worker_times_out_a_hung_user_function():
    """The function can only return once ``release`` is set, which happens after the answer:
    so a "timed out" answer did not wait for it (no wall-clock bound to flake on a busy box)."""
    release = threading.Event()
    registry = ScorerRegistry()
    registry.add(Scorer("hung", "user", lambda *a, **k: release.wait(60) and 1.0), default=True)
    worker = RewardWorker(None, registry, "unit", item_timeout_s=0.05)  # queue unused by score()
    try:
        result = await worker.score(req("42", source="x"))
        assert "timed out" in result.error
    finally:
        release.set()
        worker.close()


async def test_worker_reports_unknown_source_as_item_error():
    worker = RewardWorker(None, build_registry(RewardConfig()), "unit")
    result = await worker.score(req("42", source="nope"))
    assert result.error.startswith("NotFound: no scorer for data_source 'nope'")


# ---- validation and conversions ------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"id": ""}, "id must be"),  # the service numbers missing ids before validating
        ({"id": "x" * 257}, "id must be"),
        ({"data_source": ""}, "data_source or scorer"),
        ({"solution_str": "x" * (MAX_TEXT_BYTES + 1)}, "solution_str is"),
        ({"solution_str": 42}, "solution_str must be a string"),
        ({"extra_info": [1]}, "extra_info must be an object"),
        ({"extra_info": {"x": float("nan")}}, "extra_info is not JSON"),
    ],
)
def test_bad_requests_are_invalid_argument(changes, message):
    request = req("42")
    for name, value in changes.items():
        setattr(request, name, value)
    with pytest.raises(InvalidArgument, match=message):
        request.validate()


def test_batch_rejects_duplicate_ids():
    validate_batch([req("1"), ScoreRequest("r2", "arith", "2")])
    with pytest.raises(InvalidArgument, match="duplicate id 'r1'"):
        validate_batch([req("1"), req("2")])


def test_from_dict_checks_names_and_types():
    raw = {"id": "a", "data_source": "arith", "solution_str": "1", "ground_truth": "1"}
    assert ScoreRequest.from_dict(raw) == ScoreRequest("a", "arith", "1", "1")
    with pytest.raises(InvalidArgument, match="unknown ScoreRequest fields"):
        ScoreRequest.from_dict({**raw, "response": "1"})
    with pytest.raises(InvalidArgument, match="missing ScoreRequest fields"):
        ScoreRequest.from_dict({"id": "a"})
    with pytest.raises(InvalidArgument, match="must be a JSON object"):
        ScoreRequest.from_dict([raw])


def test_json_round_trip():
    request = req("42", extra_info={"index": 3, "tags": ["a"]}, scorer="arith")
    assert ScoreRequest.from_json(request.to_json()) == request
    result = ScoreResult("r1", 0.5, {"acc": 1.0}, "")
    assert ScoreResult.from_json(result.to_json()) == result


def test_proto_round_trip_keeps_ints_in_extra_info():
    request = req("42", extra_info={"index": 3, "ratio": 0.5, "nested": [{"k": 2}], "ok": True})
    back = request_from_proto(request_to_proto(request))
    assert back == request
    assert isinstance(back.extra_info["index"], int) and back.scorer is None


def test_verl_row_to_request():
    row = {
        "data_source": "arith",
        "response": "42",
        "reward_model": {"ground_truth": 42},
        "extra_info": {"index": 7},
    }
    request = row_to_request(row, 5, "response")
    assert (request.id, request.ground_truth, request.extra_info) == ("5", 42, {"index": 7})
    with pytest.raises(InvalidArgument, match="no 'completion' field"):
        row_to_request(row, 5, "completion")
