"""Exact auto-resume through a real fleet: a GAE run is SIGKILLed, started again with
``trainer.resume_mode=auto``, and its next step equals the uninterrupted one.

One fleet (``rlfleet up --no-trainer``: embedded Redis, router, one HF replica, reward, and the
refcritic holding the critic) serves two trainer processes in turn. The first runs steps 1-3
(a checkpoint after step 2) and is SIGKILLed after logging step 3, before it can finish. The
second starts with the same command: it resumes at step 3 from ``global_step_2`` (actor,
optimizer, schedule, data position, RNG, and the critic, which it loads back into the
refcritic: the critic there had already taken step 3's update), pushes its weights to the
replica as a version newer than any the killed run pushed, and trains step 3 again. Its step
3 must match the killed run's: the same batch (scores, lengths, advantages, returns, values)
and the same actor and critic losses. The final validation also samples 2 answers per
held-out prompt (``trainer.val_n=2``): mean@2, best@2 and maj@2 through the real fleet.
Prompts are drawn by the difficulty pools (``data.pass_rate_sampling``): their pass rates and
random stream come back from the checkpoint, so step 3 draws the same prompts again.
The resumed run's bookkeeping tells the whole run: its step-3 row is marked (``segment: 1``,
``retrained: true``), and the summary reports the first trainer's held-out accuracy before its
first step (not the checkpoint's) and the training time of both segments.

Why greedy: the trainer seeds its sampling requests only with ``trainer.deterministic``, so
generation at a temperature above 0 differs between two runs on one replica; greedy decoding
(``rollout.temperature=0``) is the deterministic path here. The RNG state still matters: mini-batches of 4 out of 8 sequences
are drawn with the trainer's torch RNG.
"""

from __future__ import annotations

import ast
import json
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import ServiceProcess

from rlfleet.common.endpoints import read_endpoints
from rlfleet.common.redis_server import free_port

pytestmark = pytest.mark.slow

SETTINGS = [
    "rollout.backend=hf",
    "rollout.n=1",
    "rollout.temperature=0",
    "algorithm.adv_estimator=gae",
    "algorithm.lam=0.95",
    "trainer.use_kl_loss=false",
    "trainer.mode=sync",
    "data.train_batch_size=8",
    "trainer.ppo_mini_batch_size=4",
    "trainer.lr=1e-3",
    "refcritic.critic_lr=1e-3",
    "trainer.val_before_train=true",
    "data.val_size=32",
    "trainer.total_steps=3",
    "trainer.save_freq=2",
    "trainer.logger=[jsonl]",
    "trainer.val_n=2",
    "trainer.replica_wait_s=300",
    "data.pass_rate_sampling.enable=true",
]
NOT_COMPARED = (
    "timing_s/",
    "weight_sync/",
    "weight/pause_s",
    "perf/",
    "training/weight_version",
    "segment",
    "retrained",
)
"""Wall-clock times and weight-push sizes and versions differ between runs by nature; the
resumed run's rows are marked as such (``segment``, ``retrained``)."""


@dataclass
class Fleet:
    process: ServiceProcess
    addresses: list[str]
    """Overrides that point a trainer at this fleet."""


def _ready(run_dir: Path) -> dict | None:
    endpoints = read_endpoints(run_dir)
    return endpoints if {"router", "reward", "refcritic", "redis"} <= set(endpoints) else None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    run_dir = tmp_path_factory.mktemp("resume-fleet")
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "up",
        "--no-trainer",
        "--rollout-replicas",
        "1",
        f"run_dir={run_dir}",
        f"cluster=resume{free_port()}",
        *SETTINGS,
    ]
    up = ServiceProcess.start(argv, run_dir / "up.log", name="rlfleet up")
    try:
        endpoints = up.wait_until(lambda: _ready(run_dir), 300, "writing endpoints")
        up.wait_healthy(endpoints["reward"]["grpc"], "rlfleet.v1.Reward")
        up.wait_healthy(endpoints["refcritic"]["grpc"], "rlfleet.v1.RefCritic")
        up.wait_for_line("serving at", 300)
        addresses = [f"redis_url={endpoints['redis']['url']}"] + [
            f"endpoints.{role}={endpoints[role]['grpc']}"
            for role in ("router", "reward", "refcritic")
        ]
        yield Fleet(up, addresses)
    finally:
        up.stop(signal.SIGINT, grace_s=30)


def start_trainer(fleet: Fleet, run_dir: Path, log_name: str) -> ServiceProcess:
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "trainer",
        *SETTINGS,
        *fleet.addresses,
        f"run_dir={run_dir}",
        f"trainer.port={free_port()}",
    ]
    return ServiceProcess.start(argv, run_dir / log_name, name="trainer")


def step_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logged_before(trainer: ServiceProcess) -> dict:
    """The held-out metrics a trainer logged before its first step."""
    line = next(x for x in trainer.log().splitlines() if "held-out before training: " in x)
    return ast.literal_eval(line.split("held-out before training: ", 1)[1])


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NOT_COMPARED)}


def test_sigkill_then_auto_resume_repeats_the_next_step_exactly(fleet: Fleet, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = start_trainer(fleet, run_dir, "trainer-1.log")
    try:
        first.wait_until(
            lambda: any(r["step"] == 3 for r in step_records(run_dir)), 180, "logging step 3"
        )
        first.kill()  # SIGKILL while it validates and saves after its last step
        assert first.wait(30) == -signal.SIGKILL, "the trainer finished before it was killed"
    finally:
        first.stop(signal.SIGKILL)
    assert not (run_dir / "summary.json").exists()
    killed = step_records(run_dir)
    assert [r["step"] for r in killed] == [1, 2, 3]
    # a reward before the checkpoint, so the critic saved with it has learnt something
    assert any(r["critic/score/mean"] > 0 for r in killed[:2]) and killed[1]["critic/grad_norm"]
    checkpoint = run_dir / "checkpoints" / "global_step_2"
    assert (checkpoint / "trainer_state.pt").is_file() and (checkpoint / "critic").is_dir()

    second = start_trainer(fleet, run_dir, "trainer-2.log")
    try:
        assert second.wait(180) == 0, second.log_tail()
    finally:
        second.stop(signal.SIGKILL)
    log = second.log()
    assert f"resumed from {checkpoint} at step 2" in log
    assert "critic restored from" in log and "(critic step 2)" in log
    resumed = step_records(run_dir)[len(killed) :]
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["segment"] == 1 and resumed[0]["retrained"] is True  # marked as step 3 again
    assert not any("segment" in r or "retrained" in r for r in killed)
    # the replica took the resumed weights as a newer version than any the killed run pushed
    assert resumed[0]["weight_sync/replicas"] == 1.0
    assert resumed[0]["training/weight_version"] > killed[-1]["training/weight_version"]
    expected, got = comparable(killed[-1]), comparable(resumed[0])
    assert set(got) == set(expected)
    assert {"actor/pg_loss", "critic/vf_loss", "critic/advantages/mean"} <= set(got)
    assert got == expected
    # the difficulty pools saw every trained prompt: 8 a step (rollout.n=1: never a spread)
    assert [r["data/pass_rate/seen_prompts"] for r in killed] == [8.0, 16.0, 24.0]
    assert got["data/pass_rate/spread_share/arith"] == 0.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    # the run's story, not the second segment's: the first trainer's start, both segments' time
    assert summary["segments"] == 2 and "held-out before training (first segment)" in log
    assert summary["val_before"] == logged_before(first) != {}
    trained = sum(r["timing_s/step"] for r in killed[:2]) + resumed[0]["timing_s/step"]
    assert summary["training_time_s"] >= round(trained, 1) - 0.1
    # validation through the fleet: greedy mean@1 first, then the sampled pass's numbers
    after = summary["val_after"]
    assert list(after)[0] == "val-core/arith/reward/mean@1"
    for name in ("mean@2", "best@2", "maj@2"):
        assert 0.0 <= after[f"val-core/arith/reward/{name}"] <= 1.0
    assert after["val-core/arith/reward/best@2"] >= after["val-core/arith/reward/mean@2"]
    samples = (run_dir / "val_samples.jsonl").read_text().splitlines()
    assert {"step", "prompt", "response", "ground_truth", "score"} == set(json.loads(samples[-1]))
