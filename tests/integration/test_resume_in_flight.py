"""Resume with work in flight, through real processes: an async ``keep`` run's trainer is
SIGKILLed while the replica continues requests across weight updates, started again with
``trainer.resume_mode=auto``, and every step trains exactly the prompts an uninterrupted run
trains, none skipped, none twice.

One fleet (``rlfleet up --no-trainer``: embedded Redis, router, one HF replica under
``rollout.update_policy=keep``, reward) serves two trainer processes in turn
(``trainer.mode=async``, ``max_staleness=1``: the next batch is generated while the actor
updates, so each push lands on requests in flight). The policy is a copy of the tiny model
that takes ``<unk>`` (never sampled) as end-of-sequence, so every completion runs its whole
``max_tokens`` and the pushes land mid-generation: the replica's ``/metrics`` must show
requests continued across updates. The first trainer is SIGKILLed once it has logged step 3
(a checkpoint after step 2; the producer is generating the next batches then). The second
resumes from ``global_step_2``: batches produced but not trained by the killed run are not
saved, they are generated again from the checkpoint's data position (the same prompts).

What "exact" means here: under ``keep`` with asynchronous pushes the tokens depend on when
each push lands, so losses are not compared (``test_exact_resume.py`` compares them on the
synchronous, greedy path); the prompts of every step are, against the data order
(``rlfleet.trainer.data.batches``), read from ``train_samples.jsonl`` (with 4 prompts a step
it holds every prompt).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import urllib.request
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import pytest
from procs import ROOT, ServiceProcess
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.common.endpoints import read_endpoints
from rlfleet.common.redis_server import free_port
from rlfleet.trainer.data import batches, read_rows, to_record
from rlfleet.trainer.samples import prompt_text

MODEL = ROOT / "models" / "tiny-qwen2-arith"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
UNK, STEPS, BATCH, PROMPTS = 3, 5, 4, 64
ARITH = ROOT / "data" / "arith" / "train.jsonl"
CONFIG = ROOT / "configs" / "default.yaml"
"""The default async job (GRPO, no KL, no refcritic), made small and long-generating below."""
RESUMED = "rlfleet_rollout_update_resumed_requests_total"
DISCARDED = "rlfleet_rollout_update_discarded_tokens_total"


def long_model(target: Path) -> Path:
    """The tiny model with ``<unk>`` as its end-of-sequence token."""
    shutil.copytree(MODEL, target)
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((target / name).read_text())
        raw["eos_token_id"] = UNK
        (target / name).write_text(json.dumps(raw))
    tok = json.loads((target / "tokenizer_config.json").read_text())
    tok["eos_token"] = "<unk>"
    (target / "tokenizer_config.json").write_text(json.dumps(tok))
    return target


def small_train_file(target: Path) -> Path:
    """The first ``PROMPTS`` training prompts (tokenizing all 4,000 costs each trainer start)."""
    target.write_text("".join(ARITH.read_text().splitlines(keepends=True)[:PROMPTS]))
    return target


def settings(model: Path, train_file: Path) -> list[str]:
    return [
        f"data.train_files=[{train_file}]",
        f"model.path={model}",
        "rollout.backend=hf",
        "rollout.update_policy=keep",
        "rollout.n=2",
        "rollout.max_tokens=48",
        "rollout.max_model_len=64",
        "data.max_prompt_length=16",
        "trainer.mode=async",
        "trainer.max_staleness=1",
        f"data.train_batch_size={BATCH}",
        "trainer.ppo_mini_batch_size=8",
        f"trainer.total_steps={STEPS}",
        "trainer.save_freq=2",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "data.val_size=4",
        "trainer.replica_wait_s=120",
    ]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], dict, Path]]:
    """(the trainer's settings and addresses, the fleet's endpoints, the training prompts)."""
    root = tmp_path_factory.mktemp("inflight-fleet")
    run_dir, model = root / "fleet", long_model(root / "model")
    train_file = small_train_file(root / "train.jsonl")
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "up",
        "--config",
        str(CONFIG),
        "--no-trainer",
        "--rollout-replicas",
        "1",
        f"run_dir={run_dir}",
        f"cluster=inflight{free_port()}",
        *settings(model, train_file),
    ]
    run_dir.mkdir()
    up = ServiceProcess.start(argv, run_dir / "up.log", name="rlfleet up")
    try:
        endpoints = up.wait_until(lambda: _ready(run_dir), 180, "writing endpoints")
        up.wait_for_line("serving at", 180)
        addresses = [f"redis_url={endpoints['redis']['url']}"] + [
            f"endpoints.{role}={endpoints[role]['grpc']}" for role in ("router", "reward")
        ]
        yield [*settings(model, train_file), *addresses], endpoints, train_file
    finally:
        up.stop(signal.SIGINT, grace_s=30)


def _ready(run_dir: Path) -> dict | None:
    endpoints = read_endpoints(run_dir)
    return endpoints if {"router", "reward", "redis", "rollout-0"} <= set(endpoints) else None


def start_trainer(overrides: list[str], run_dir: Path, log_name: str) -> ServiceProcess:
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "trainer",
        "--config",
        str(CONFIG),
        *overrides,
        f"run_dir={run_dir}",
        f"trainer.port={free_port()}",
        "trainer.resume_mode=auto",
    ]
    return ServiceProcess.start(argv, run_dir / log_name, name="trainer")


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def prompts_by_step(samples: list[dict]) -> dict[int, list[str]]:
    """Each step's prompts (one run's rows: each step written once)."""
    out: dict[int, list[str]] = {}
    for row in samples:
        out.setdefault(row["step"], []).append(row["prompt"])
    return {step: sorted(prompts) for step, prompts in out.items()}


def expected_prompts(train_file: Path) -> dict[int, list[str]]:
    records = [to_record(r, "train") for r in read_rows(train_file)]
    order = islice(batches(records, BATCH, 0), STEPS)
    return {s: sorted(prompt_text(r.prompt) for r in b) for s, b in enumerate(order, 1)}


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_sigkill_with_requests_in_flight_under_keep_resumes_every_prompt_once(fleet, tmp_path):
    overrides, endpoints, train_file = fleet
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics, samples = run_dir / "metrics.jsonl", run_dir / "train_samples.jsonl"
    first = start_trainer(overrides, run_dir, "trainer-1.log")
    try:
        first.wait_until(lambda: any(r["step"] >= 3 for r in rows(metrics)), 120, "step 3")
        first.kill()  # the producer is generating the next batches under keep
        assert first.wait(30) == -signal.SIGKILL, "the trainer finished before it was killed"
    finally:
        first.stop(signal.SIGKILL)
    killed, killed_samples = rows(metrics), rows(samples)
    assert (run_dir / "checkpoints" / "global_step_2" / "trainer_state.pt").is_file()
    second = start_trainer(overrides, run_dir, "trainer-2.log")
    try:
        assert second.wait(120) == 0, second.log_tail()
    finally:
        second.stop(signal.SIGKILL)
    assert "resumed from" in second.log() and "at step 2" in second.log()
    resumed = rows(metrics)[len(killed) :]
    assert [r["step"] for r in resumed if "timing_s/step" in r] == [3, 4, 5]
    expected, before = expected_prompts(train_file), prompts_by_step(killed_samples)
    after = prompts_by_step(rows(samples)[len(killed_samples) :])
    assert sorted(after) == [3, 4, 5]
    assert {**before, **after} == expected  # every step, the run that trained it last
    for step, prompts in before.items():
        assert prompts == expected[step], f"the killed run trained other prompts at {step}"
    replica = counters(endpoints["rollout-0"]["metrics"])
    assert replica[RESUMED] > 0, "no request was in flight across an update"
    assert replica[DISCARDED] == 0
