"""``run_dir/train_samples.jsonl``: a few of each step's training samples, for the dashboard.

Why a file: validation samples already go to ``val_samples.jsonl`` (``loggers.SamplesFile``);
what the policy answers while it trains was only in memory. A handful of rows per step (the
first sample of the first groups) is enough to watch answers change, and costs nothing next to
a step. Written only when the ``jsonl`` logger is on, next to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlfleet.trainer.rollout_batch import RolloutBatch

FILE_NAME = "train_samples.jsonl"


class TrainSamples:
    """Appends ``per_step`` rows ``{step, prompt, response, score, weight_version, replica}``."""

    def __init__(self, path: Path | None, per_step: int = 4) -> None:
        self.path = path
        self.per_step = per_step

    @classmethod
    def from_config(cls, config) -> TrainSamples:
        wanted = "jsonl" in config.trainer.logger and config.dashboard.samples > 0
        return cls(Path(config.run_dir) / FILE_NAME if wanted else None)

    def write(self, step: int, batch: RolloutBatch) -> None:
        if self.path is None or not batch.texts:
            return
        rows = [_row(step, batch, i) for i in _first_of_groups(batch, self.per_step)]
        with self.path.open("a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


def _first_of_groups(batch: RolloutBatch, limit: int) -> list[int]:
    """Index of the first sequence of each group, for the first ``limit`` groups."""
    seen: dict[int, int] = {}
    for i, group in enumerate(batch.group_ids or range(len(batch.texts))):
        if group not in seen:
            seen[group] = i
            if len(seen) == limit:
                break
    return list(seen.values())


def _row(step: int, batch: RolloutBatch, i: int) -> dict[str, Any]:
    return {
        "step": step,
        "prompt": prompt_text(batch.records[i].prompt) if i < len(batch.records) else "",
        "response": batch.texts[i] if i < len(batch.texts) else "",
        "score": batch.scores[i] if i < len(batch.scores) else None,
        "weight_version": batch.weight_versions[i] if i < len(batch.weight_versions) else None,
        "replica": batch.replica_ids[i] if i < len(batch.replica_ids) else "",
    }


def prompt_text(prompt: Any) -> str:
    """A plain prompt as is; chat messages as their last user turn (what was asked)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        users = [m for m in prompt if m.get("role") == "user"] or prompt
        return str(users[-1].get("content", ""))
    return str(prompt)
