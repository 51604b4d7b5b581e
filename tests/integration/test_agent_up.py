"""Agent mode through ``rlfleet up``, started the way users start it: the launcher starts the
env role beside the router, replicas and trainer; episodes come back token-native and train.

Each test is a short run (2 steps of 2 tasks x 2 episodes drawn from 64 training rows, 4
held-out tasks, one rollout replica, no dashboard) of ``configs/agent_calc.yaml`` with the
environment named in ``agent.env``: the built-in ``calc``, then users' environments from
``examples/agents`` (a Gymnasium-shaped text env and a TRL ``environment_factory`` class). The
conventions that drive the gateway or a server (verifiers, an ``openai``-client agent,
OpenEnv) are in ``test_agent_up_conventions``.
"""

from __future__ import annotations

import json
import time

import pytest
from agent_train_rows import calc_train_rows, train_files_override
from up_proc import failure_report, read_metrics, run_up

TASKS, GROUP = 2, 2  # the smallest batch that still forms GRPO groups
SMALL = [
    "data.val_size=4",
    "trainer.test_freq=2",
    f"data.train_batch_size={TASKS}",
    f"rollout.n={GROUP}",
    "dashboard.enabled=false",
]


@pytest.fixture(scope="module")
def train_rows(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``data.train_files``: a few of the job's training rows (``agent_train_rows``)."""
    return train_files_override(calc_train_rows(tmp_path_factory.mktemp("calc")))


def trained_steps(run_dir) -> list[dict]:
    return [
        row for row in read_metrics(run_dir) if "actor/pg_loss" in row or "agent/episodes" in row
    ]


@pytest.mark.parametrize(
    "env, multi_turn",
    [
        ("calc", True),
        ("examples.agents.text_env:SumByParts", True),
        ("examples.agents.trl_adder:AdderEnv", True),
    ],
)
def test_episodes_train_through_the_whole_fleet(tmp_path, train_rows, env, multi_turn):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = run_up(
        run_dir,
        "hf",
        steps=2,
        config="agent_calc.yaml",
        replicas=1,
        extra=[*SMALL, train_rows, f"agent.env={env}", f"cluster=agent{abs(hash(env)) % 997}"],
    )
    print(f"rlfleet up agent.env={env}: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, failure_report(result, run_dir)
    steps = trained_steps(run_dir)
    assert [row["step"] for row in steps] == [1, 2], failure_report(result, run_dir)
    for row in steps:
        assert row["agent/episodes"] == TASKS * GROUP
        assert row["agent/failed"] == 0.0
        assert row["response_length/mean"] > 0
        if multi_turn:
            assert row["agent/turns/mean"] > 1
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    assert "env" in endpoints
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "val-core/calc/reward/mean@1" in summary["val_before"]  # whole greedy episodes
    assert "val-core/calc/reward/mean@1" in summary["val_after"]
