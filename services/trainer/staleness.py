"""What the trainer does with responses older than its weights: drop the too old, measure the rest.

Why a module of its own: the learner (``Trainer.train_step_async``) applies these to every
asynchronous batch, and the producer (``rlfleet.trainer.pipeline``) is what makes batches
stale; both sit above this, so neither has to import the other for it.
"""

from __future__ import annotations

from rlfleet.trainer.rollout_batch import RolloutBatch


def drop_stale(batch: RolloutBatch, oldest: int) -> tuple[RolloutBatch, int]:
    """Keep the rows generated with version >= ``oldest``; returns (kept, dropped count)."""
    keep = [i for i, version in enumerate(batch.weight_versions) if version >= oldest]
    if len(keep) == len(batch):
        return batch, 0
    return batch.select(keep), len(batch) - len(keep)


def staleness_metrics(batch: RolloutBatch, version: int, dropped: int) -> dict[str, float]:
    """Rows' lag behind ``version`` (a row's is its oldest token's), and per sampled token
    when the batch records a version per token (agent mode)."""
    lags = [version - v for v in batch.weight_versions] or [0]
    tokens = [version - v for row in batch.token_versions for v in row if v >= 0] or lags
    return {
        "async/staleness/mean": sum(lags) / len(lags),
        "async/staleness/max": float(max(lags)),
        "async/staleness/token_mean": sum(tokens) / len(tokens),
        "async/staleness/token_max": float(max(tokens)),
        "async/dropped": float(dropped),
    }
