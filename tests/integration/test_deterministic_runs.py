"""``trainer.deterministic``: the default job, run twice through the whole fleet (`rlfleet up`:
embedded Redis, router, two HF rollout replicas, reward, trainer) in sync mode with the same
seed and sampling at temperature 0.7, writes the same ``metrics.jsonl``, byte for byte, once
the columns that measure time are left out; a run with another seed does not.

Each run is 3 steps of 4 prompts x 8 samples with a sampled validation (``val_n=2``) after
step 3, so the training and both validation passes' seeds are all in the compared rows.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from procs import ServiceProcess
from up_proc import up_argv

pytestmark = pytest.mark.slow

TIMED = re.compile(
    r"^timing_s/"  # seconds of each phase of a step
    r"|^training/time_s$"  # the training clock, in validation rows
    r"|^weight_sync/(push_s_max|push_s_mean|.+/seconds)$"  # seconds each weight push took
    r"|^weight/pause_s(/.+)?$"  # seconds each replica stopped serving for an update
    r"|^perf/grpc_calls(/ListReplicas)?$"  # the trainer polls ListReplicas while it waits
    r"|^health/(stalled|throughput_drop)$"  # flags computed from the step's seconds
)
"""The only columns left out of the comparison: each is a clock reading, or counts or flags
what a clock decided."""


EXTRA = [
    "trainer.mode=sync",
    "trainer.deterministic=true",
    "rollout.temperature=0.7",
    "trainer.test_freq=3",
    "trainer.val_n=2",
]


def start_run(tmp_path: Path, name: str, seed: int, steps: int) -> ServiceProcess:
    argv = up_argv(tmp_path / name, "hf", steps, [*EXTRA, f"trainer.seed={seed}"])
    return ServiceProcess.start(argv, tmp_path / f"{name}.log", name=name)


def untimed_lines(run_dir: Path) -> list[str]:
    """``metrics.jsonl`` as written (the writer's ``json.dumps``), without the ``TIMED`` keys."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [json.dumps({k: v for k, v in row.items() if not TIMED.search(k)}) for row in rows]


def test_one_seed_gives_the_same_metrics_and_another_seed_does_not(tmp_path):
    """The three runs at once: what each replica is sent, and when, differs between the two
    with one seed (three fleets share the cores), so equal rows say the timing did not count.
    The other seed's run is one step: its first row is what differs."""
    runs = [start_run(tmp_path, "first", 0, 3), start_run(tmp_path, "second", 0, 3)]
    runs.append(start_run(tmp_path, "other", 1, 1))
    try:
        for run in runs:
            assert run.wait(timeout=600) == 0, run.log_tail(60)
    finally:
        for run in runs:
            run.stop(signal.SIGKILL)
    first, second = untimed_lines(tmp_path / "first"), untimed_lines(tmp_path / "second")
    assert len(first) == 4  # steps 1-3 and the validation after step 3
    assert "val-core/arith/reward/mean@2" in json.loads(first[-1])
    assert second == first
    order = (tmp_path / "first" / "data_order.jsonl").read_text()
    assert order == (tmp_path / "second" / "data_order.jsonl").read_text()
    assert [json.loads(line)["step"] for line in order.splitlines()] == [1, 2, 3]
    other = json.loads(untimed_lines(tmp_path / "other")[0])
    assert other["actor/entropy"] != json.loads(first[0])["actor/entropy"]
