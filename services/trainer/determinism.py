"""Reproducible runs (``trainer.deterministic``): per-request seeds, seeded RNGs, results in
request order, and the data order of every step.

Why each piece (docs/algorithms.md, "Reproducible runs"):

- A request's seed is a hash of the run's seed, a stream name, the step and the prompt's
  position, so it names one sample of one run and nothing else: two runs of one config ask the
  same questions with the same seeds, and neighbouring steps, prompts or runs get unrelated
  streams (a sum such as ``seed + step`` would give run 1's step 0 the seed of run 0's step 1).
  The HF engine samples a seeded request alone, under its own RNG, so its completions do not
  depend on what else a replica had queued.
- The trainer's own draws (the PPO epochs' row order) come from RNGs seeded once at start.
- Results are matched to their requests by id before anything is computed from them, so a
  reduction over a batch adds its rows in request order, never in arrival order.
- ``data_order.jsonl`` says which prompts each step trained on, to compare two runs (or find
  the prompt behind a metric) without replaying the shuffle.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rlfleet.common.errors import FailedPrecondition

if TYPE_CHECKING:
    from rlfleet.reward.types import ScoreRequest, ScoreResult
    from rlfleet.rollout.types import GenerateRequest, GenerateResult

R = TypeVar("R")

DATA_ORDER_FILE = "data_order.jsonl"


def request_seed(run_seed: int, stream: str, step: int, position: int) -> int:
    """The seed of one sampling request, in [0, 2**63): the first 8 bytes of
    ``sha256("rlfleet/{run_seed}/{stream}/{step}/{position}")``, big-endian, shifted right by
    one bit (a proto int64). ``stream`` names the pass (``train``, ``train-r1`` for DAPO's
    first refill round, ``baseline`` for ReMax's greedy ones, ``val``, ``val-sampled``);
    ``step`` is the number of steps trained before the request (the metrics row's step - 1 for
    training requests); ``position`` is the prompt's position in its batch or held-out set."""
    key = f"rlfleet/{run_seed}/{stream}/{step}/{position}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1


def in_request_order(
    ids: Sequence[str], results: Sequence[R], id_of: Callable[[R], str]
) -> list[R]:
    """``results`` rearranged to the order of the request ``ids`` they answer; a result for an
    unknown id, a duplicate, or a request left unanswered is an error, not a silent gap."""
    by_id = {id_of(r): r for r in results}
    if len(by_id) != len(results) or set(by_id) != set(ids) or len(ids) != len(results):
        missing = sorted(set(ids) - set(by_id))[:3]
        raise FailedPrecondition(
            f"{len(results)} results do not answer the {len(ids)} requests one to one "
            f"(unanswered: {missing})"
        )
    return [by_id[i] for i in ids]


def generations_in_order(
    requests: Sequence[GenerateRequest], results: Sequence[GenerateResult]
) -> list[GenerateResult]:
    """``GenerateResult``s in the order of their ``GenerateRequest``s."""
    return in_request_order([r.request_id for r in requests], results, lambda r: r.request_id)


def scores_in_order(
    requests: Sequence[ScoreRequest], results: Sequence[ScoreResult]
) -> list[ScoreResult]:
    """``ScoreResult``s in the order of their ``ScoreRequest``s."""
    return in_request_order([r.id for r in requests], results, lambda r: r.id)


def seed_process(seed: int, deterministic: bool) -> None:
    """Seed torch (always: the actor's row order comes from it); with ``deterministic`` also
    Python's and numpy's RNGs, and make torch refuse ops without a deterministic kernel."""
    import torch

    torch.manual_seed(seed)
    if not deterministic:
        return
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    # cuBLAS is deterministic only with a fixed workspace (torch raises without one); read at
    # the first cuBLAS call, which comes later. Not measured: no GPU run is tested.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


class DataOrder:
    """``run_dir/data_order.jsonl``: ``{"step": s, "prompts": [i, ...]}`` per trained step,
    the position in ``data.train_files`` (read in order) of each prompt group, in batch order.
    Written when the ``jsonl`` logger is on (as ``metrics.jsonl``); ``path`` None: nowhere."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    @classmethod
    def from_config(cls, config) -> DataOrder:
        wanted = "jsonl" in config.trainer.logger
        return cls(Path(config.run_dir) / DATA_ORDER_FILE if wanted else None)

    def write(self, step: int, indices: list[int]) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, "prompts": indices}) + "\n")
