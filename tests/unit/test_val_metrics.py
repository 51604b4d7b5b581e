"""Validation with n samples per prompt: mean@n, best@n, maj@n on hand-computed examples,
the evaluator's passes with in-process fakes of the router and the reward service, and the
sample table read back from the loggers."""

from __future__ import annotations

import asyncio
import json

import pytest
from trainer_fakes import RecordingSync

from rlfleet.common.config import load_config
from rlfleet.reward.types import ScoreRequest, ScoreResult
from rlfleet.rollout.types import Completion, GenerateRequest, GenerateResult
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.evaluate import SAMPLE_COLUMNS, Evaluator
from rlfleet.trainer.fleet import Fleet, Generator, ScoreService
from rlfleet.trainer.loggers import Tracker, markdown_table
from rlfleet.trainer.val_metrics import answer_of, majority_score, sampled_metrics

# Three prompts, four samples each (worked by hand below).
SOURCES = ["a", "a", "b"]
SCORES = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
ANSWERS = [["5", "3", "3", "5"], ["1", "2", "2", "2"], ["7", "7", "7", "8"]]


def test_answer_is_the_scorers_pred_else_the_stripped_text():
    assert answer_of("  42 \n") == "42"
    assert answer_of("x", {"pred": 3}) == answer_of("y", {"pred": 3.0}) == "3.0"
    assert answer_of(" x", {"acc": 1.0}) == "x"


def test_majority_vote_scores_the_most_frequent_answer_ties_to_the_first_seen():
    assert majority_score([0.0, 1.0, 1.0], ["4", "5", "5"]) == 1.0
    # "5" and "3" both twice: "5" came first, and its first sample scored 1
    assert majority_score(SCORES[0], ANSWERS[0]) == 1.0
    assert majority_score([0.0, 1.0], ["3", "5"]) == 0.0
    with pytest.raises(ValueError, match="as many answers"):
        majority_score([1.0], ["1", "2"])


def test_mean_best_maj_at_n_per_data_source():
    metrics = sampled_metrics(SOURCES, SCORES, ANSWERS)
    # a: prompt 1 mean .5 best 1 maj 1 ("5"); prompt 2 mean 0 best 0 maj 0 ("2")
    # b: prompt 3 mean .75 best 1 maj 1 ("7")
    assert metrics == {
        "val-core/a/reward/mean@4": 0.25,
        "val-core/a/reward/best@4": 0.5,
        "val-core/a/reward/maj@4": 0.5,
        "val-core/b/reward/mean@4": 0.75,
        "val-core/b/reward/best@4": 1.0,
        "val-core/b/reward/maj@4": 1.0,
    }


def test_uneven_sample_counts_are_refused():
    with pytest.raises(ValueError, match="same number"):
        sampled_metrics(["a", "a"], [[1.0], [1.0, 0.0]], [["1"], ["1", "2"]])


# --- the evaluator against in-process fakes -----------------------------------------------


class ScriptedRollout(Generator):
    """Prompt i answers with ``SCRIPT[i][:n]`` (token ids are digits); greedy takes the first."""

    SCRIPT = [[5, 3, 3, 5], [1, 2, 2, 2], [7, 7, 7, 8]]

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        index = int(request.request_id.rsplit("-", 1)[1])
        tokens = self.SCRIPT[index][: request.sampling.n]
        completions = [Completion([t], [0.0], "", "stop") for t in tokens]
        return GenerateResult(request.request_id, completions, 1, "fake")

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return [await self.generate(request) for request in requests]

    async def close(self) -> None:
        pass


class TruthReward(ScoreService):
    """1.0 when the text equals the ground truth."""

    async def score_batch(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        return [
            ScoreResult(r.id, float(r.solution_str.strip() == r.ground_truth)) for r in requests
        ]

    async def close(self) -> None:
        pass


class DigitTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def evaluator(**overrides) -> Evaluator:
    config = load_config(None, [f"{k}={v}" for k, v in overrides.items()], env={})
    return Evaluator(
        config, Fleet(ScriptedRollout(), TruthReward(), None, RecordingSync()), DigitTokenizer()
    )


RECORDS = [
    PromptRecord("p0", "a", "5", {}, [0]),
    PromptRecord("p1", "a", "9", {}, [1]),
    PromptRecord("p2", "b", "7", {}, [2]),
]


def test_validation_is_greedy_mean_at_1_then_sampled_metrics_and_sample_rows():
    result = asyncio.run(
        evaluator(**{"trainer.val_n": 4, "trainer.log_val_generations": 2}).validate(RECORDS, 1)
    )
    # greedy answers 5, 1, 7 -> all: 2 / 3 first (two sources), a: (1 + 0) / 2, b: 1
    assert list(result.metrics)[:3] == [
        "val-core/all/reward/mean@1",
        "val-core/a/reward/mean@1",
        "val-core/b/reward/mean@1",
    ]
    assert result.metrics["val-core/all/reward/mean@1"] == pytest.approx(2 / 3)
    assert result.metrics["val-core/a/reward/mean@1"] == 0.5
    assert result.metrics["val-core/b/reward/mean@1"] == 1.0
    # sampled: prompt 0 scores [1,0,0,1] maj "5" (tie, first); prompt 1 all 0; prompt 2 [1,1,1,0]
    assert result.metrics["val-core/a/reward/mean@4"] == 0.25
    assert result.metrics["val-core/a/reward/best@4"] == 0.5
    assert result.metrics["val-core/a/reward/maj@4"] == 0.5
    assert result.metrics["val-core/b/reward/maj@4"] == 1.0
    assert result.samples == [
        {"prompt": "0", "response": "5", "ground_truth": "5", "score": 1.0},
        {"prompt": "1", "response": "1", "ground_truth": "9", "score": 0.0},
    ]
    assert list(result.samples[0]) == list(SAMPLE_COLUMNS)


def test_one_sample_means_greedy_only():
    result = asyncio.run(evaluator().validate(RECORDS, 1))
    assert sorted(result.metrics) == [
        "val-core/a/reward/mean@1",
        "val-core/all/reward/mean@1",
        "val-core/b/reward/mean@1",
    ]
    one_source = asyncio.run(evaluator().validate(RECORDS[:2], 1))
    assert list(one_source.metrics) == ["val-core/a/reward/mean@1"]  # no "all" for one source


def test_val_n_and_temperature_are_checked():
    with pytest.raises(ValueError, match="val_n"):
        load_config(None, ["trainer.val_n=0"], env={})
    with pytest.raises(ValueError, match="val_temperature"):
        load_config(None, ["trainer.val_temperature=0"], env={})


# --- the table through the loggers ------------------------------------------------------

ROWS = [
    {"prompt": "12+30=", "response": "42", "ground_truth": "42", "score": 1.0},
    {"prompt": "1+1=", "response": "3|x", "ground_truth": "2", "score": 0.0},
]


def test_markdown_table_escapes_pipes():
    text = markdown_table(["a", "b"], [["x|y", 1]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| x\\|y | 1 |"]


def tracker(tmp_path, *loggers: str) -> Tracker:
    config = load_config(
        None,
        [f"trainer.logger=[{', '.join(loggers)}]", "trainer.experiment_name=exp"],
        env={},
    )
    return Tracker.from_config(config, tmp_path)


def test_samples_go_to_val_samples_jsonl(tmp_path):
    writer = tracker(tmp_path, "console", "jsonl")
    writer.log_samples(0, ROWS)
    writer.log_samples(5, ROWS[:1])
    writer.close()
    lines = (tmp_path / "val_samples.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, **ROWS[0]},
        {"step": 0, **ROWS[1]},
        {"step": 5, **ROWS[0]},
    ]


def test_no_jsonl_logger_no_samples_file(tmp_path):
    writer = tracker(tmp_path, "console")
    writer.log_samples(0, ROWS)
    writer.close()
    assert not (tmp_path / "val_samples.jsonl").exists()


@pytest.mark.slow
def test_samples_read_back_from_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tracker(tmp_path, "tensorboard")
    writer.log_samples(3, ROWS)
    writer.close()
    events = EventAccumulator(
        str(tmp_path / "tensorboard" / "rlfleet" / "exp"), size_guidance={"tensors": 0}
    ).Reload()
    (event,) = events.Tensors("val/generations/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3
    assert "| prompt | response | ground_truth | score |" in text
    assert "| 12+30= | 42 | 42 | 1.0 |" in text and "3\\|x" in text


@pytest.mark.slow
def test_samples_read_back_from_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow.tracking import MlflowClient

    writer = tracker(tmp_path, "mlflow")
    writer.log_samples(2, ROWS)
    writer.close()
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    run_id = writer.backends["mlflow"].run_id
    path = client.download_artifacts(run_id, "val_generations/step_2.json", str(tmp_path))
    table = json.loads(open(path).read())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"][0] == ["12+30=", "42", "42", 1.0]
