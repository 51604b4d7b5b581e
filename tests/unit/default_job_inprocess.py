"""The default job (``configs/default.yaml``) with its services in-process: the transformers
engine (``HFEngine``) generates and takes each push, the arithmetic scorer scores, the trainer's
own loop trains. No Redis, no process, no port: a run of a few dozen steps takes seconds.

Shared by the run-health tests (``test_health_runs``, ``test_health_broken_runs``) and the
rollout-correction preset sweep (``bench/bench_presets.py``). A replica can be broken on
purpose: ``stale`` (it acknowledges every push and keeps serving its first weights), or
``hold`` (from a given call on, each generation waits a multiple of the time between the
replica's calls so far: a replica that stalls once, or one that keeps slowing every step).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfleet.common.config import RlfleetConfig, load_config
from rlfleet.model.model_io import load_causal_lm, load_tokenizer
from rlfleet.reward.types import ScoreRequest, ScoreResult
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.types import GenerateRequest, GenerateResult, ReplicaStatus
from rlfleet.tasks import arith
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.data import load_records
from rlfleet.trainer.fleet import Fleet, Generator, ScoreService, WeightPublisher
from rlfleet.trainer.health import assess
from rlfleet.trainer.loggers import StepWriter
from rlfleet.trainer.run import TrainingClock, train_loop
from rlfleet.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "models" / "tiny-qwen2-arith" / "model.safetensors"


@dataclass(frozen=True)
class Hold:
    """Generation calls ``first`` .. ``last`` (1-based) wait ``factor`` times the median time
    between the replica's calls before ``first`` (at least ``min_s``): measured, not fixed, so
    the held step stands out against the run's own pace on a fast machine or a loaded one."""

    first: int
    last: int
    factor: float
    min_s: float = 0.0


class InProcessReplica(Generator, WeightPublisher):
    """One replica on the transformers engine, also its own weight sync. A push waits for
    the generation in progress (``rollout.update_policy: finish``); ``stale``: the replica
    says it took each push and keeps serving the weights it started with; ``hold``: it
    stalls the calls it names."""

    def __init__(self, engine: HFEngine, stale: bool = False, hold: Hold | None = None) -> None:
        self.engine, self.stale, self.hold, self.version = engine, stale, hold, 0
        self._lock = asyncio.Lock()
        self._calls: list[float] = []
        self.held_s = 0.0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return (await self.generate_batch([request]))[0]

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        await self._maybe_hold()
        async with self._lock:
            version = self.version
            return await asyncio.gather(*(self._one(r, version) for r in requests))

    async def _maybe_hold(self) -> None:
        self._calls.append(time.monotonic())
        hold, count = self.hold, len(self._calls)
        if hold is None or not hold.first <= count <= hold.last or count < 3:
            return
        before = self._calls[: min(count, hold.first)]
        gaps = sorted(b - a for a, b in zip(before, before[1:], strict=False))
        wait = max(hold.factor * gaps[len(gaps) // 2], hold.min_s)
        self.held_s += wait
        await asyncio.sleep(wait)

    async def _one(self, request: GenerateRequest, version: int) -> GenerateResult:
        prompt = request.prompt_token_ids or []  # the trainer always sends token ids
        completions = await self.engine.generate(request.request_id, prompt, request.sampling)
        return GenerateResult(request.request_id, completions, version, "replica-0")

    async def push(
        self, state_dict: dict, version: int, flush_cache: bool = True, only_stale: bool = False
    ) -> dict[str, float]:
        async with self._lock:
            if not self.stale:
                await self.engine.load_weights(state_dict)
            self.version = version
        return {}

    async def wait_for_replicas(self, count: int, timeout_s: float) -> list[ReplicaStatus]:
        return []

    async def close(self) -> None:
        pass


class ArithReward(ScoreService):
    async def score_batch(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        return [ScoreResult(r.id, arith.score(r.solution_str, r.ground_truth)) for r in requests]

    async def close(self) -> None:
        pass


class Rows(StepWriter):
    """The metrics rows in memory; ``on_row`` sees each (it may ask the trainer to stop)."""

    def __init__(self, on_row: Callable[[Mapping[str, float]], None] | None = None) -> None:
        self.rows: list[dict] = []
        self.on_row = on_row

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rows.append({"step": step, **metrics})
        if self.on_row is not None:
            self.on_row(metrics)

    def log_samples(self, step: int, samples: list[Mapping]) -> None:
        pass


def default_job(run_dir: Path, steps: int, *overrides: str) -> RlfleetConfig:
    """The shipped job, ``steps`` of it, on the transformers engine, 32 held-out prompts
    (``overrides`` come last and win)."""
    items = [
        f"run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "rollout.backend=hf",
        "data.val_size=32",
        *overrides,
    ]
    return load_config(str(ROOT / "configs" / "default.yaml"), items, env={})


async def train(
    config: RlfleetConfig,
    stale: bool = False,
    hold: Hold | None = None,
    stop: Callable[[Mapping[str, float]], bool] | None = None,
) -> list[dict]:
    """Train ``config`` in-process; the metrics rows. ``stop``: asked of each row, True stops
    the run after it (at the end of its step)."""
    torch.manual_seed(config.trainer.seed)
    tokenizer = load_tokenizer(config.model.path)
    model = load_causal_lm(config.model.path, config.model.dtype, config.model.attn_implementation)
    engine = HFEngine(config)
    await engine.start()
    replica = InProcessReplica(engine, stale, hold)
    trainer = Trainer(
        config, Fleet(replica, ArithReward(), None, replica), Actor(config, model, 0), tokenizer
    )
    data = config.data
    train_rows = load_records(data.train_files, tokenizer, data.max_prompt_length)
    val = load_records(data.val_files, tokenizer, data.max_prompt_length)[: data.val_size]

    def on_row(row: Mapping[str, float]) -> None:
        if stop is not None and stop(row):
            trainer.stop_requested = True

    writer = Rows(on_row)
    try:
        await trainer.start(0, 1.0)
        await train_loop(
            trainer, train_rows, writer, val, TrainingClock(config.trainer.target_accuracy)
        )
    finally:
        await engine.close()
    return writer.rows


def judged_run(caplog, config: RlfleetConfig, **train_kwargs) -> tuple[set[str], list[str]]:
    """Train (``train``'s keywords); the rules flagged in the rows and the WARNING lines the
    rules logged. Replaying the rows (``rlfleet status``) finds no rule the rows did not flag."""
    caplog.set_level(logging.INFO, logger="rlfleet.trainer.health")
    rows = asyncio.run(train(config, **train_kwargs))
    flagged = {
        k.removeprefix("health/")
        for row in rows
        for k, v in row.items()
        if k.startswith("health/") and v
    }
    assert flagged >= {f.rule for f in assess(rows, config.trainer.health)}
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "rlfleet.trainer.health" and r.levelno == logging.WARNING
    ]
    return flagged, warned
