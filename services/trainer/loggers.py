"""Step metrics fanned out to the experiment trackers named in ``trainer.logger``.

verl's names and choices: ``console``, ``jsonl`` (``run_dir/metrics.jsonl``), ``tensorboard``
(event files under ``run_dir/tensorboard``), ``wandb`` (offline by default, under
``run_dir/wandb``: no network or account needed; ``wandb sync`` uploads later, or set
``WANDB_MODE=online``) and ``mlflow`` (a local file store, ``run_dir/mlruns``, unless
``MLFLOW_TRACKING_URI`` says otherwise). Runs are filed under ``trainer.project_name`` /
``trainer.experiment_name``. The last three backends are optional packages (the ``loggers``
extra); asking for one that is not installed fails at start-up, not after an hour of training.

``Tracker`` keeps the history in memory (the reward plot and the control server read it) and
has ``MetricsWriter``'s ``write``/``history``/``path``, so it drops in where that was used.

Validation generations (a few rows of prompt, response, ground truth, score) go through
``Tracker.log_samples`` to every backend with a ``log_table``: ``run_dir/val_samples.jsonl``
(with ``jsonl``, one line per row), a TensorBoard text table, a W&B ``Table`` and an MLflow JSON
artifact (``val_generations/step_N.json``); the console logs them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

from rlfleet.common.config import RlfleetConfig
from rlfleet.trainer.metrics import MetricsWriter

log = logging.getLogger(__name__)

KEY_NUMBERS = {
    "critic/score/mean": "score",
    "actor/pg_loss": "pg_loss",
    "actor/kl_loss": "kl",
    "actor/entropy": "entropy",
    "response_length/mean": "len",
    "timing_s/step": "s/step",
}
"""The numbers worth a glance every step: console lines and the progress bar show these."""


class Backend(Protocol):
    """One destination for step metrics."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class TableBackend(Backend, Protocol):
    """A backend that also shows tables (validation generations)."""

    def log_table(self, step: int, columns: list[str], rows: list[list]) -> None: ...


class StepWriter(Protocol):
    """Where the training loop writes each step's metrics and validation samples
    (``Tracker``; the loop's tests hand in doubles that keep rows in memory)."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_samples(self, step: int, samples: list[Mapping]) -> None: ...


class LoggerUnavailable(RuntimeError):
    """A configured logger's package is not installed."""


def _require(module: str, logger: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise LoggerUnavailable(
            f"trainer.logger includes {logger!r} but {module!r} is not installed: "
            f"pip install 'rlfleet[loggers]' (or drop {logger!r} from trainer.logger)"
        ) from exc


def progress_postfix(metrics: Mapping[str, float]) -> dict[str, str]:
    """The key numbers of a step, formatted for ``tqdm.set_postfix``."""
    return {short: f"{metrics[key]:.3g}" for key, short in KEY_NUMBERS.items() if key in metrics}


class ConsoleBackend:
    """A log line with the key numbers every ``every`` steps (verl's ``console``); the progress
    bar shows them live, so a line per step would only break the bar up."""

    def __init__(self, every: int = 25) -> None:
        self.every = every

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        numbers = " | ".join(f"{k} {v}" for k, v in progress_postfix(metrics).items())
        if numbers and step % self.every == 0:
            log.info("step %d | %s", step, numbers)

    def log_table(self, step: int, columns: list[str], rows: list[list]) -> None:
        """One line per validation, not per row: a glimpse of what the policy answers."""
        if rows:
            samples = " || ".join(" | ".join(map(repr, row)) for row in rows)
            log.info("step %d validation samples (%s): %s", step, " | ".join(columns), samples)

    def close(self) -> None:
        pass


class SamplesFile:
    """``val_samples.jsonl``: one JSON object per logged row, with its step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def log_table(self, step: int, columns: list[str], rows: list[list]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            for row in rows:
                record = {"step": step, **dict(zip(columns, row, strict=True))}
                handle.write(json.dumps(record) + "\n")


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table (TensorBoard renders text summaries as Markdown)."""

    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in rows])


class TensorBoardBackend:
    """Scalars in TensorBoard event files (``tensorboard --logdir run_dir/tensorboard``)."""

    def __init__(self, log_dir: Path) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_table(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text("val/generations", markdown_table(columns, rows), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run, offline unless ``WANDB_MODE`` says otherwise; the config is its config."""

    def __init__(self, run_dir: Path, project: str, name: str, config: dict) -> None:
        wandb = _require("wandb", "wandb")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=name,
            config=config,
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(silent=True),
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, step: int, columns: list[str], rows: list[list]) -> None:
        import wandb

        self.run.log({"val/generations": wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-. /]")


class MlflowBackend:
    """An MLflow run in experiment ``project``; metrics batched per step, config as an artifact."""

    def __init__(self, tracking_uri: str, project: str, name: str, config: dict) -> None:
        # MLflow 3 refuses its file store unless asked; a local store is the point here.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        tracking = _require("mlflow.tracking", "mlflow")
        self.client = tracking.MlflowClient(tracking_uri=tracking_uri)
        experiment = self.client.get_experiment_by_name(project)
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [
            Metric(_MLFLOW_BAD_CHARS.sub("_", key), value, now, step)
            for key, value in metrics.items()
            if math.isfinite(value)
        ]
        for start in range(0, len(rows), 1000):  # MLflow's per-call limit
            self.client.log_batch(self.run_id, metrics=rows[start : start + 1000])

    def log_table(self, step: int, columns: list[str], rows: list[list]) -> None:
        table = {"step": step, "columns": columns, "data": rows}
        self.client.log_dict(self.run_id, table, f"val_generations/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Tracker:
    """Sends each step's metrics to every configured backend; keeps the history."""

    def __init__(self, backends: dict[str, Backend]) -> None:
        self.backends = backends
        self.history: list[dict] = []
        self.segment = 0
        """0 for a fresh run; 1 after the first resume, and so on (``resume``)."""
        jsonl = backends.get("jsonl")
        self.path: Path | None = jsonl.path if isinstance(jsonl, MetricsWriter) else None
        self.samples_file = (
            SamplesFile(self.path.parent / "val_samples.jsonl") if self.path else None
        )

    @classmethod
    def from_config(cls, config: RlfleetConfig, run_dir: Path | None = None) -> Tracker:
        """Backends for ``trainer.logger``, files under ``run_dir`` (default ``config.run_dir``)."""
        run_dir = Path(run_dir or config.run_dir)
        backends: dict[str, Backend] = {}
        try:
            for name in dict.fromkeys(config.trainer.logger):
                backends[name] = _build(name, config, run_dir)
        except Exception:
            cls(backends).close()
            raise
        return cls(backends)

    def resume(self, step: int) -> None:
        """This run goes on from a checkpoint at ``step``: ``metrics.jsonl`` marks the rows
        to come (``MetricsWriter.resume``), and the history (the reward plot, StreamMetrics)
        starts with the earlier segments' rows that still stand."""
        jsonl = self.backends.get("jsonl")
        if not isinstance(jsonl, MetricsWriter):  # no file: nothing to mark, nothing to read
            self.segment += 1
            return
        standing = jsonl.resume(step)
        self.segment = jsonl.segment
        self.history = [
            {k: v if k == "step" else float(v) for k, v in row.items()} for row in standing
        ]  # numbers only, as ``log`` keeps them

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        values = {key: float(value) for key, value in metrics.items()}
        self.history.append({"step": step, **values})
        for name, backend in self.backends.items():
            try:
                backend.log(step, values)
            except Exception:  # a tracker's hiccup must not stop training
                log.warning("logger %s failed at step %d", name, step, exc_info=True)

    write = log
    """``MetricsWriter``'s name for ``log``."""

    def log_samples(self, step: int, samples: list[Mapping]) -> None:
        """Validation generations (dicts with the same keys) to every backend with tables."""
        if not samples:
            return
        columns = list(samples[0])
        rows = [[sample[c] for c in columns] for sample in samples]
        tables: dict[str, TableBackend | SamplesFile] = {
            name: b for name, b in self.backends.items() if isinstance(b, TableBackend)
        }
        if self.samples_file is not None:
            tables["val_samples.jsonl"] = self.samples_file
        for name, backend in tables.items():
            try:
                backend.log_table(step, columns, rows)
            except Exception:  # a tracker's hiccup must not stop training
                log.warning("logger %s failed to log samples at step %d", name, step, exc_info=True)

    def close(self) -> None:
        for name, backend in self.backends.items():
            try:
                backend.close()
            except Exception:
                log.warning("logger %s failed to close", name, exc_info=True)


def experiment_name(config: RlfleetConfig, run_dir: Path) -> str:
    """``trainer.experiment_name``, else the run directory's name."""
    return config.trainer.experiment_name or run_dir.resolve().name


def _build(name: str, config: RlfleetConfig, run_dir: Path) -> Backend:
    project, experiment = config.trainer.project_name, experiment_name(config, run_dir)
    if name == "console":
        return ConsoleBackend()
    if name == "jsonl":
        return MetricsWriter(run_dir / "metrics.jsonl")
    if name == "tensorboard":
        return TensorBoardBackend(run_dir / "tensorboard" / project / experiment)
    if name == "wandb":
        return WandbBackend(run_dir, project, experiment, config.model_dump(mode="json"))
    if name == "mlflow":
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"file:{(run_dir / 'mlruns').resolve()}"
        return MlflowBackend(uri, project, experiment, config.model_dump(mode="json"))
    raise ValueError(f"unknown logger {name!r}; valid: console, jsonl, tensorboard, wandb, mlflow")
