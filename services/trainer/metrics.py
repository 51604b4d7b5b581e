"""Step metrics under verl's names, written one JSON line per step (the pictures drawn from
them at the end of a run are ``rlfleet.trainer.report``'s).

Names follow verl (``critic/score/mean``, ``actor/pg_loss``, ``timing_s/gen`` ...) so
dashboards and scripts written for verl read our ``metrics.jsonl`` unchanged.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}/mean": sum(values) / len(values),
        f"{prefix}/max": float(max(values)),
        f"{prefix}/min": float(min(values)),
    }


def batch_metrics(batch, max_response_length: int) -> dict[str, float]:
    """Score, length and version metrics of one rollout batch."""
    lengths = [float(n) for n in batch.sampled_lengths()]  # agent mode: sampled tokens only
    prompt_lengths = [float(len(p)) for p in batch.prompts]
    if batch.row_loss_masks() is not None:  # agent mode: an episode cut by its token budget
        clipped = sum(1 for reason in batch.finish_reasons if reason == "token_budget")
    else:
        clipped = sum(1 for n in lengths if n >= max_response_length)
    metrics = {
        **_stats("critic/score", batch.scores),
        **_stats("response_length", lengths),
        **_stats("prompt_length", prompt_lengths),
        "response_length/clip_ratio": clipped / max(1, len(lengths)),
        "reward/errors": float(batch.score_errors),
        "rollout/replicas_used": float(len(set(batch.replica_ids))),
        "perf/total_num_tokens": sum(prompt_lengths) + sum(lengths),
        **zero_variance_fraction(batch.scores, batch.group_ids),
    }
    return metrics


def zero_variance_fraction(scores: list[float], group_ids: list) -> dict[str, float]:
    """``batch/zero_variance_fraction``: the share of groups (of two samples or more) whose
    samples all scored the same, so their group-relative advantage is 0 (DAPO's argument;
    with ``algorithm.filter_groups`` such groups were dropped before and ``dapo/*`` count
    them). Watched by ``rlfleet.trainer.health``; {} when no group has two samples."""
    groups: dict = {}
    for score, group in zip(scores, group_ids, strict=True):
        groups.setdefault(group, []).append(score)
    judged = [values for values in groups.values() if len(values) > 1]
    if not judged:
        return {}
    alike = sum(1 for values in judged if max(values) == min(values))
    return {"batch/zero_variance_fraction": alike / len(judged)}


def tensor_stats(prefix: str, tensor, mask) -> dict[str, float]:
    """Mean/max/min of a ``[B, R]`` tensor over its response mask."""
    selected = tensor[mask.bool()]
    if selected.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": selected.mean().item(),
        f"{prefix}/max": selected.max().item(),
        f"{prefix}/min": selected.min().item(),
    }


def rollout_probs_diff(
    engine: list[list[float]], actor: list[list[float]], masks: list[list[int]] | None = None
) -> dict[str, float]:
    """verl's ``training/rollout_probs_diff_{max,mean,std}``: ``|exp(engine) - exp(actor)|``
    per response token, the engine's log-prob of each sampled token against the actor's
    recomputed one, over the rows given (the caller passes only rows sampled with the weights
    the actor holds). Why: a replica serving other weights than the actor's (a push that lost
    precision, a tensor the engine did not load) shows here as more than numerical noise.
    ``masks`` (agent mode): only positions marked 1 (sampled by the policy) count."""
    diffs = []
    for row, (engine_row, actor_row) in enumerate(zip(engine, actor, strict=True)):
        keep = masks[row] if masks is not None else [1] * len(actor_row)
        diffs += [
            abs(math.exp(e) - math.exp(a))
            for e, a, k in zip(engine_row, actor_row, keep, strict=True)
            if k
        ]
    if not diffs:
        return {}
    mean = sum(diffs) / len(diffs)
    std = math.sqrt(sum((d - mean) ** 2 for d in diffs) / len(diffs))
    return {
        "training/rollout_probs_diff_max": max(diffs),
        "training/rollout_probs_diff_mean": mean,
        "training/rollout_probs_diff_std": std,
    }


class Timer:
    """Collects ``timing_s/<name>`` for the phases of a step."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.metrics[f"timing_s/{name}"] = time.perf_counter() - started

    async def timed(self, name: str, coroutine_fn, *args):
        """Await ``coroutine_fn(*args)`` and record its duration (for phases run concurrently).

        The coroutine is created here, not by the caller: a task cancelled before it starts
        (a ``gather`` sibling failed) then leaves no never-awaited coroutine behind."""
        with self.phase(name):
            return await coroutine_fn(*args)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` (verl's ``file`` logger); keeps
    history for the plot.

    A resumed run (``resume``) appends to the same file, and marks what it writes: every row
    carries ``segment`` (1 after the first resume, 2 after the second, ...), and a row of a step
    that an earlier segment had already logged (trained again after the checkpoint) carries
    ``retrained: true`` as well. Rows of a fresh run carry neither. One row per step: for each
    step, the rows of the highest ``segment`` that logged it (``standing_rows``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.history: list[dict] = []
        self.segment = 0
        self.logged_through = 0
        """The last step an earlier segment logged: rows up to it are ``retrained``."""

    def resume(self, step: int) -> list[dict]:
        """This run goes on from a checkpoint at ``step``: number the segment, and return the
        earlier segments' rows that still stand (steps up to ``step``)."""
        rows = read_rows(self.path)
        end_torn_line(self.path)  # else the first new row would be glued to a killed one's
        self.segment = 1 + max((int(r.get("segment", 0)) for r in rows), default=0)
        self.logged_through = max((int(r["step"]) for r in rows), default=0)
        self.history = standing_rows(rows, step)
        return list(self.history)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **self._marks(step), **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def _marks(self, step: int) -> dict:
        if not self.segment:
            return {}
        return {
            "segment": self.segment,
            **({"retrained": True} if step <= self.logged_through else {}),
        }

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """The ``jsonl`` backend of ``rlfleet.trainer.loggers.Tracker``."""
        self.write(step, dict(metrics))

    def close(self) -> None:
        """Nothing is held open: every write appends and closes the file."""


def read_rows(path: Path) -> list[dict]:
    """Every row of a ``metrics.jsonl`` (a torn last line, from a killed run, is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def end_torn_line(path: Path) -> None:
    """Close a last line a killed writer left unfinished, so the next row starts on its own."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as handle:
        handle.seek(-1, 2)
        if handle.read(1) != b"\n":
            handle.write(b"\n")


def standing_rows(rows: list[dict], through: int | None = None) -> list[dict]:
    """The rows that stand, in file order: for each step (up to ``through``), those of the
    latest segment that logged it; what a dead segment logged after its checkpoint is
    superseded by the segment that trained those steps again."""
    latest: dict[int, int] = {}
    for row in rows:
        if through is None or row["step"] <= through:
            latest[row["step"]] = max(latest.get(row["step"], 0), int(row.get("segment", 0)))
    return [
        row
        for row in rows
        if row["step"] in latest and int(row.get("segment", 0)) == latest[row["step"]]
    ]
