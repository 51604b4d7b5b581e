"""The parity probe's judgement (``rlfleet.trainer.weight_check``) on hand-made numbers: the
gap is of probabilities, an answer that does not fit is an infinite gap, and a replica over
the bound is named in an ERROR line and drained while the others serve on."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest

from rlfleet.common.config import load_config
from rlfleet.common.errors import Unavailable
from rlfleet.rollout.types import ReplicaState, ReplicaStatus, ScoreRequest, TokenScores
from rlfleet.trainer.weight_check import (
    METRIC,
    Expected,
    ReplicaProbe,
    WeightCheck,
    default_bound,
    parity,
    parity_metrics,
    probe_of,
)

LOG = math.log


def test_the_gap_is_the_largest_probability_difference_and_says_where():
    expected = [[LOG(0.5), LOG(0.25)], [LOG(0.9)]]
    got = TokenScores([[LOG(0.4), LOG(0.25)], [LOG(0.6)]], 3)
    result = parity("r0", 3, expected, got)
    assert result.max_abs_diff == pytest.approx(0.3)
    assert result.where == (1, 0)
    assert parity("r0", 3, expected, TokenScores(expected, 3)).max_abs_diff == 0.0


@pytest.mark.parametrize(
    "rows",
    [
        [[LOG(0.5)], [LOG(0.9)]],  # a token missing
        [[LOG(0.5), LOG(0.25)]],  # a sequence missing
        [[LOG(0.5), float("nan")], [LOG(0.9)]],
        [[LOG(0.5), -math.inf], [LOG(0.9)]],
    ],
)
def test_an_answer_that_does_not_fit_is_an_infinite_gap(rows):
    expected = [[LOG(0.5), LOG(0.25)], [LOG(0.9)]]
    assert parity("r0", 1, expected, TokenScores(rows, 1)).max_abs_diff == math.inf


def test_metrics_are_the_max_over_replicas_and_each_replicas_own():
    results = [parity("a", 1, [[0.0]], TokenScores([[LOG(0.9)]], 1))]
    results.append(parity("b", 1, [[0.0]], TokenScores([[LOG(0.5)]], 1)))
    metrics = parity_metrics(results)
    assert metrics[METRIC] == pytest.approx(0.5)
    assert metrics[f"{METRIC}/a"] == pytest.approx(0.1)
    assert metrics[f"{METRIC}/b"] == pytest.approx(0.5)
    assert parity_metrics([]) == {}


def test_the_probe_keeps_the_first_token_as_context_and_fits_the_model_length():
    probe = probe_of([[1, 2, 3, 4, 5], [7, 8], [9]], tokens=3, max_len=4)
    assert probe.prompts == [[1], [7]]  # [1,2,3,4] cut to 4; [9] has nothing to score
    assert probe.targets == [[2, 3, 4], [8]]
    assert probe_of([[1, 2, 3, 4, 5]], 2, 32).prompts == [[1, 2, 3]]
    with pytest.raises(ValueError, match="two tokens"):
        probe_of([[1]], 2, 32)


def test_the_default_bound_is_tight_only_when_both_sides_compute_in_fp32():
    assert default_bound("float32", False, "float32") == 0.01
    assert default_bound("bfloat16", False, "float32") == 0.1
    assert default_bound("float32", True, "float32") == 0.1  # the actor autocasts to bf16
    assert default_bound("float32", False, "bfloat16") == 0.1


class FakeFleet(ReplicaProbe):
    """Replicas that answer fixed scores (one of them wrong), and a record of drains."""

    def __init__(self, answers: dict[str, TokenScores | Exception], versions: dict[str, int]):
        self.answers, self.versions = answers, versions
        self.drained: list[str] = []
        self.asked: list[ScoreRequest] = []

    async def list_replicas(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(rid, f"addr-{rid}", v, ReplicaState.SERVING, 0, "hf", 0, 0.0)
            for rid, v in self.versions.items()
        ]

    async def score_tokens(self, replica: ReplicaStatus, request: ScoreRequest) -> TokenScores:
        self.asked.append(request)
        answer = self.answers[replica.replica_id]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def drain_replica(self, replica_id: str) -> None:
        self.drained.append(replica_id)

    async def close(self) -> None:
        pass


def make_check(fleet: FakeFleet, *overrides: str) -> WeightCheck:
    config = load_config(None, ["trainer.weight_check.enable=true", *overrides])
    probe = probe_of([[1, 2, 3]], tokens=2, max_len=32)
    return WeightCheck(config, probe, fleet, bound=0.05)


EXPECTED = Expected(4, [[LOG(0.8), LOG(0.5)]])


def test_a_replica_over_the_bound_is_named_and_drained_the_others_serve_on(caplog):
    fleet = FakeFleet(
        {
            "good": TokenScores([[LOG(0.81), LOG(0.5)]], 4),
            "bad": TokenScores([[LOG(0.8), LOG(0.2)]], 4),  # kept its old weights
            "gone": Unavailable("connection refused"),
            "newer": TokenScores([[LOG(0.1), LOG(0.1)]], 5),  # a later push landed first
        },
        {"good": 4, "bad": 4, "gone": 4, "newer": 4, "behind": 3},
    )
    check = make_check(fleet)
    with caplog.at_level(logging.ERROR):
        metrics = asyncio.run(check.check(EXPECTED))
    assert fleet.drained == ["bad"]
    assert metrics[METRIC] == pytest.approx(0.3)
    assert metrics[f"{METRIC}/good"] == pytest.approx(0.01)
    assert f"{METRIC}/gone" not in metrics and f"{METRIC}/newer" not in metrics
    assert f"{METRIC}/behind" not in metrics  # not at the probed version: not asked
    assert all(r.min_weight_version == 4 for r in fleet.asked)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "replica bad at weight version 4" in errors[0] and "0.3 away" in errors[0]


def test_warn_leaves_the_replica_serving():
    fleet = FakeFleet({"bad": TokenScores([[LOG(0.8), LOG(0.2)]], 4)}, {"bad": 4})
    check = make_check(fleet, "trainer.weight_check.on_mismatch=warn")
    assert asyncio.run(check.check(EXPECTED))[METRIC] == pytest.approx(0.3)
    assert fleet.drained == []


def test_every_skips_versions_but_never_the_first_check():
    check = make_check(FakeFleet({}, {}), "trainer.weight_check.every=3")
    assert check.due(7)  # the run's first
    asyncio.run(check.check(Expected(7, [[0.0, 0.0]])))
    assert not check.due(8) and check.due(9)


def test_the_check_needs_a_single_process_actor():
    with pytest.raises(ValueError, match="strategy: single"):
        load_config(
            None,
            [
                "trainer.weight_check.enable=true",
                "trainer.strategy=ddp",
                "trainer.world_size=2",
            ],
        )


def test_a_score_request_and_its_answer_survive_the_proto():
    from rlfleet.rollout import convert
    from rlfleet.rollout.types import ScoredSequence

    request = ScoreRequest([ScoredSequence([1, 2], [3]), ScoredSequence([4], [5, 6])], 7)
    back = convert.score_request_from_proto(convert.score_request_to_proto(request))
    assert back == request
    scores = TokenScores([[-0.5], [-1.25, -2.0]], 7, "r0")
    assert convert.scores_from_proto(convert.scores_to_proto(scores)) == scores


@pytest.mark.parametrize(
    ("sequences", "version", "field"),
    [
        ([], 0, "sequences"),
        ([([], [1])], 0, r"sequences\[0\].prompt_token_ids"),
        ([([1], [-1])], 0, r"sequences\[0\].target_token_ids"),
        ([([1], [True])], 0, r"sequences\[0\].target_token_ids"),
        ([([1], [2])], -1, "min_weight_version"),
        ([([1] * 20_000, [2])], 0, "sequences hold 20001 tokens"),
    ],
)
def test_a_bad_score_request_names_its_field(sequences, version, field):
    from rlfleet.common.errors import InvalidArgument
    from rlfleet.rollout.types import ScoredSequence

    request = ScoreRequest([ScoredSequence(p, t) for p, t in sequences], version)
    with pytest.raises(InvalidArgument, match=field):
        request.validate()


def test_a_router_that_does_not_answer_skips_the_check_and_fails_nothing():
    class NoRouter(FakeFleet):
        async def list_replicas(self) -> list[ReplicaStatus]:
            raise Unavailable("router down")

    assert asyncio.run(make_check(NoRouter({}, {})).check(EXPECTED)) == {}
