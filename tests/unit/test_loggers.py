"""Each ``trainer.logger`` backend logs a few steps into tmp_path and the test reads them back
with the backend's own reader (TensorBoard's EventAccumulator, MLflow's client, the W&B
record log). Optional backends are skipped when their package is not installed."""

import glob
import json
import logging
import struct
import sys
import time

import pytest

from rlfleet.common.config import load_config
from rlfleet.trainer.loggers import LoggerUnavailable, Tracker, progress_postfix

STEPS = [
    {"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "timing_s/step": 1.5},
    {"critic/score/mean": 0.5, "actor/pg_loss": -0.25, "timing_s/step": 1.25},
    {"critic/score/mean": 0.75, "actor/pg_loss": 0.0, "val/acc@arith": 0.9},
]


def track(tmp_path, *loggers: str) -> Tracker:
    """A tracker for ``loggers`` that has logged STEPS as steps 1..3 and been closed."""
    config = load_config(
        overrides=[
            f"trainer.logger=[{', '.join(loggers)}]",
            "trainer.project_name=proj",
            "trainer.experiment_name=exp",
        ]
    )
    tracker = Tracker.from_config(config, tmp_path)
    for step, metrics in enumerate(STEPS, start=1):
        tracker.log(step, metrics)
    tracker.close()
    return tracker


def test_console_and_jsonl_read_back(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="rlfleet.trainer.loggers"):
        tracker = track(tmp_path, "console", "jsonl")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": i + 1, **m} for i, m in enumerate(STEPS)
    ]
    assert tracker.path == tmp_path / "metrics.jsonl"
    assert tracker.history[1] == {"step": 2, **STEPS[1]}


def test_console_logs_every_nth_step(caplog) -> None:
    from rlfleet.trainer.loggers import ConsoleBackend

    console = ConsoleBackend(every=2)
    with caplog.at_level(logging.INFO, logger="rlfleet.trainer.loggers"):
        for step, metrics in enumerate(STEPS, start=1):
            console.log(step, metrics)
    assert "step 2 | score 0.5 | pg_loss -0.25 | s/step 1.25" in caplog.text
    assert "step 1 |" not in caplog.text and "step 3 |" not in caplog.text


def test_history_is_kept_without_jsonl(tmp_path) -> None:
    tracker = track(tmp_path, "console")
    assert tracker.path is None and len(tracker.history) == 3
    assert not (tmp_path / "metrics.jsonl").exists()


def test_progress_postfix_shows_the_key_numbers() -> None:
    assert progress_postfix(STEPS[0]) == {"score": "0.25", "pg_loss": "-0.5", "s/step": "1.5"}


def test_a_failing_backend_does_not_stop_the_others(tmp_path, caplog) -> None:
    class Broken:
        def log(self, step, metrics):
            raise OSError("disk full")

        def close(self):
            pass

    tracker = Tracker({"broken": Broken()})
    tracker.log(1, {"x": 1.0})
    assert tracker.history == [{"step": 1, "x": 1.0}]
    assert "logger broken failed at step 1" in caplog.text


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(LoggerUnavailable, match=r"'wandb' is not installed.*rlfleet\[loggers\]"):
        track(tmp_path, "jsonl", "wandb")


@pytest.mark.slow
def test_tensorboard_event_files_read_back(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    track(tmp_path, "tensorboard")
    events = EventAccumulator(str(tmp_path / "tensorboard" / "proj" / "exp")).Reload()
    scores = events.Scalars("critic/score/mean")
    assert [(s.step, s.value) for s in scores] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [s.value for s in events.Scalars("val/acc@arith")] == [pytest.approx(0.9)]


@pytest.mark.slow
def test_mlflow_file_store_reads_back(tmp_path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow.tracking import MlflowClient

    tracker = track(tmp_path, "mlflow")
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    run = client.get_run(tracker.backends["mlflow"].run_id)
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert client.get_metric_history(run.info.run_id, "val/acc_arith")[0].value == 0.9
    config_file = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    assert json.loads(open(config_file).read())["trainer"]["project_name"] == "proj"


def _wandb_records(path: str):
    """The protobuf records of a ``.wandb`` file: a 7-byte header, then a LevelDB-style log of
    32 KiB blocks, each chunk ``crc32 (4) | length (2) | type (1) | data`` (1 full, 2 first,
    3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, pending = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if kind == 0:
            break
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _history_row(record) -> dict:
    """One ``run.log`` call; a key with "/" is stored as a one-element ``nested_key``."""
    items = record.history.item
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


@pytest.mark.slow
def test_wandb_offline_run_reads_back(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    track(tmp_path, "wandb")
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records: list = []
    deadline = time.monotonic() + 30  # wandb's writer process may still be flushing
    while time.monotonic() < deadline:
        records = list(_wandb_records(path))
        if any(r.WhichOneof("record_type") == "run" for r in records):
            break
        time.sleep(0.5)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.display_name) == ("proj", "exp")
    rows = [_history_row(r) for r in records if r.WhichOneof("record_type") == "history"]
    assert [(row["_step"], row["critic/score/mean"]) for row in rows] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]
