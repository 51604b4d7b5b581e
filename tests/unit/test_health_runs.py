"""The run-health defaults on real runs of the default job: quiet on the shipped recipe, firing
on deliberately broken runs (a learning rate 100x too high; a replica that serves stale
weights).

The job is ``configs/default.yaml`` itself (GRPO, async with staleness 1, the shipped tiny
model, the arithmetic data) with its services in-process: the transformers engine
(``HFEngine``) generates, takes each push (or, as the stale replica, ignores it and reports
the version anyway), and the arithmetic scorer scores. A short prefix of the job runs here
(seconds); ``test_the_whole_default_job_stays_quiet`` replays the metrics of all 1,200 steps
of one such run, kept in ``tests/data/health/`` (``python tests/unit/test_health_runs.py``
trains it again and rewrites the file: about 10 minutes on 2 cores).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest
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
from rlfleet.trainer.health import PHASE_ROLES, HealthMonitor, assess
from rlfleet.trainer.loggers import StepWriter
from rlfleet.trainer.run import TrainingClock, train_loop
from rlfleet.trainer.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
WHOLE_RUN = ROOT / "tests" / "data" / "health" / "default_job_metrics.jsonl.gz"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ROOT / "models" / "tiny-qwen2-arith" / "model.safetensors").exists(),
        reason="tiny model not built",
    ),
]


class InProcessReplica(Generator, WeightPublisher):
    """One replica on the transformers engine, also its own weight sync. A push waits for
    the generation in progress (``rollout.update_policy: finish``); ``stale``: the replica
    says it took each push and keeps serving the weights it started with."""

    def __init__(self, engine: HFEngine, stale: bool = False) -> None:
        self.engine, self.stale, self.version = engine, stale, 0
        self._lock = asyncio.Lock()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return (await self.generate_batch([request]))[0]

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        async with self._lock:
            version = self.version
            return await asyncio.gather(*(self._one(r, version) for r in requests))

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
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rows.append({"step": step, **metrics})

    def log_samples(self, step: int, samples: list[Mapping]) -> None:
        pass


def default_job(run_dir: Path, steps: int, *overrides: str) -> RlfleetConfig:
    """The shipped job, a few steps of it, every health default on (``throughput_drop``
    needs 40 steps, so only the whole run below judges it)."""
    items = [
        f"run_dir={run_dir}",
        f"trainer.total_steps={steps}",
        "rollout.backend=hf",
        "data.val_size=32",
        *overrides,
    ]
    return load_config(str(ROOT / "configs" / "default.yaml"), items, env={})


async def train(config: RlfleetConfig, stale: bool) -> list[dict]:
    torch.manual_seed(config.trainer.seed)
    tokenizer = load_tokenizer(config.model.path)
    model = load_causal_lm(config.model.path, config.model.dtype, config.model.attn_implementation)
    engine = HFEngine(config)
    await engine.start()
    replica = InProcessReplica(engine, stale)
    trainer = Trainer(
        config, Fleet(replica, ArithReward(), None, replica), Actor(config, model, 0), tokenizer
    )
    data = config.data
    train_rows = load_records(data.train_files, tokenizer, data.max_prompt_length)
    val = load_records(data.val_files, tokenizer, data.max_prompt_length)[: data.val_size]
    writer = Rows()
    try:
        await trainer.start(0, 1.0)
        await train_loop(trainer, train_rows, writer, val, TrainingClock(1.0))
    finally:
        await engine.close()
    return writer.rows


def run(caplog, tmp_path, steps: int, *overrides: str, stale: bool = False):
    """Train; returns the rules flagged in the rows and the WARNING lines the rules logged."""
    caplog.set_level(logging.INFO, logger="rlfleet.trainer.health")
    config = default_job(tmp_path, steps, *overrides)
    rows = asyncio.run(train(config, stale))
    flagged = {
        k.removeprefix("health/")
        for row in rows
        for k, v in row.items()
        if k.startswith("health/") and v
    }
    assert flagged >= {f.rule for f in assess(rows, config.trainer.health)}  # replay agrees
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "rlfleet.trainer.health" and r.levelno == logging.WARNING
    ]
    return flagged, warned


def test_the_default_job_stays_quiet(caplog, tmp_path):
    flagged, warned = run(caplog, tmp_path, 30, "trainer.test_freq=10")
    assert flagged == set() and warned == []


def test_a_learning_rate_100x_too_high_fires(caplog, tmp_path):
    flagged, warned = run(caplog, tmp_path, 25, "trainer.lr=1.5e-2", "trainer.test_freq=5")
    assert {"zero_variance", "reward_flat", "heldout_flat", "mismatch_kl"} <= flagged
    assert any(line.startswith("run health: zero_variance: 100% of the groups") for line in warned)
    assert len(warned) == len(set(warned))  # once per rule until it clears


def test_a_replica_serving_stale_weights_fires(caplog, tmp_path):
    flagged, warned = run(caplog, tmp_path, 15, "trainer.test_freq=0", stale=True)
    assert "mismatch_kl" in flagged
    assert any("mismatch_kl: rollout_corr/kl" in line for line in warned)


def test_the_whole_default_job_stays_quiet():
    """All 1,200 steps of the default job (this file's harness, validation every 50 steps on
    its 500 held-out prompts), reduced to the metrics the rules read: no rule fires at any
    step, with every default on (the timing rules included)."""
    with gzip.open(WHOLE_RUN, "rt") as handle:
        rows = [json.loads(line) for line in handle]
    assert sum("training/global_step" in r for r in rows) == 1200
    config = load_config(str(ROOT / "configs" / "default.yaml"), [], env={})
    monitor = HealthMonitor(config.trainer.health)
    fired = {(k, row["step"]) for row in rows for k, v in monitor.observe(row).items() if v}
    assert fired == set()
    assert assess(rows, config.trainer.health, waiting_s=0.0) == []


KEPT = (
    "step",
    "training/global_step",
    "critic/score/mean",
    "actor/entropy",
    "rollout_corr/kl",
    "rollout_corr/chi2_token",
    "batch/zero_variance_fraction",
    "perf/total_num_tokens",
    "timing_s/step",
    *PHASE_ROLES,
)
"""What the rules read of a training row (validation rows keep their ``val-core/*``)."""


def write_whole_run(path: Path = WHOLE_RUN) -> None:
    """Train the whole default job here and keep what the rules read, rounded."""
    import tempfile

    with tempfile.TemporaryDirectory() as run_dir:
        rows = asyncio.run(
            train(
                default_job(
                    Path(run_dir), 1200, "trainer.health.enabled=false", "data.val_size=500"
                ),
                stale=False,
            )
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as handle:
        for row in rows:
            kept = {
                k: float(f"{v:.5g}")
                for k, v in row.items()
                if k in KEPT or k.startswith("val-core/")
            }
            handle.write(json.dumps(kept) + "\n")


if __name__ == "__main__":
    write_whole_run()
