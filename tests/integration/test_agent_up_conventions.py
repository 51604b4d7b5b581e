"""The conventions that drive the gateway or a server, each trained through ``rlfleet up``.

Issue 17's "done when": a verifiers ``load_environment`` module, an OpenEnv server and an
``openai``-client agent each train a few steps when named in ``agent.env`` (the text env and
the TRL class are in ``test_agent_up``). Each test is the smallest run that still trains GRPO
groups: 2 steps of 2 tasks x 2 episodes (of 64 training rows: ``agent_train_rows``), 4
held-out tasks after training only, one rollout replica, no dashboard, on
``configs/agent_calc.yaml``'s tiny tool-using policy: start-up is most of its time. The
OpenEnv server is a real one (``python -m examples.agents.openenv_guess``), started here and
stopped by its PID.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_train_rows import calc_train_rows, train_files_override
from up_proc import failure_report, read_metrics, run_up

pytestmark = pytest.mark.slow

TASKS, GROUP = 2, 2
SMALL = [
    f"data.train_batch_size={TASKS}",
    f"rollout.n={GROUP}",
    "data.val_size=4",
    "trainer.val_before_train=false",
    "dashboard.enabled=false",
]


@pytest.fixture(scope="module")
def train_rows(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``data.train_files``: a few of the job's training rows (``agent_train_rows``)."""
    return train_files_override(calc_train_rows(tmp_path_factory.mktemp("calc")))


def train(tmp_path: Path, train_rows: str, env: str, *extra: str) -> list[dict]:
    """Two steps of ``agent.env=env`` through ``rlfleet up``; the trained steps' rows."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = run_up(
        run_dir,
        "hf",
        steps=2,
        config="agent_calc.yaml",
        replicas=1,
        extra=[
            *SMALL,
            train_rows,
            f"agent.env={env}",
            f"cluster=conv{abs(hash(env)) % 997}",
            *extra,
        ],
    )
    print(f"rlfleet up agent.env={env}: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, failure_report(result, run_dir)
    rows = [row for row in read_metrics(run_dir) if "agent/episodes" in row]
    assert [row["step"] for row in rows] == [1, 2], failure_report(result, run_dir)
    for row in rows:
        assert row["agent/episodes"] == TASKS * GROUP
        assert row["agent/failed"] == 0.0
        assert row["response_length/mean"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "val-core/calc/reward/mean@1" in summary["val_after"]  # whole greedy episodes
    return rows


def test_a_verifiers_load_environment(tmp_path: Path, train_rows: str) -> None:
    """``vf.ToolEnv`` with the ``add`` tool: verifiers runs the tool calls between turns."""
    pytest.importorskip("verifiers")
    rows = train(tmp_path, train_rows, "examples.agents.verifiers_calc:load_environment")
    assert all(row["agent/turns/mean"] > 1 for row in rows)


def test_an_openai_client_agent(tmp_path: Path, train_rows: str) -> None:
    """An ``openai.AsyncOpenAI`` agent answering its own ``tool_calls``."""
    pytest.importorskip("openai")
    rows = train(tmp_path, train_rows, "examples.agents.openai_agent:run")
    assert all(row["agent/turns/mean"] > 1 for row in rows)


def test_a_verifiers_multi_turn_env_trains_every_call(tmp_path: Path, train_rows: str) -> None:
    """``vf.MultiTurnEnv`` (``Retry``: asks again until the answer is right, 3 turns at most):
    its calls re-render the conversation, and every one of them is trained (issue 28: this
    run once trained 0.95-1.0 turns per episode, the last call of each)."""
    pytest.importorskip("verifiers")
    rows = train(
        tmp_path,
        train_rows,
        "examples.agents.verifiers_calc:load_environment",
        "agent.env_kwargs={kind: multi, max_turns: 3}",
    )
    report_turns("verifiers multi", rows)
    assert all(row["agent/turns/mean"] > 1 for row in rows)


def test_an_openai_agent_cut_by_max_tokens_trains_every_call(
    tmp_path: Path, train_rows: str
) -> None:
    """The ``openai``-client agent with 8-token turns: each cut turn is asked to continue and
    re-rendered; merged where the prompts still extend one another token for token (with this
    policy's template they do), branches where not: every call's tokens are trained, more than
    one 8-token call's worth per episode."""
    pytest.importorskip("openai")
    rows = train(
        tmp_path,
        train_rows,
        "examples.agents.openai_agent:run",
        "agent.env_kwargs={max_tokens: 8, max_turns: 4}",
    )
    report_turns("openai agent, 8-token turns", rows)
    assert all(row["agent/turns/mean"] > 1 and row["agent/sampled_tokens/mean"] > 8 for row in rows)


def report_turns(what: str, rows: list[dict]) -> None:
    for row in rows:
        print(
            f"{what}: step {row['step']}: turns/mean {row['agent/turns/mean']:.2f}, "
            f"branches/mean {row['agent/branches/mean']:.2f}, sampled_tokens/mean "
            f"{row['agent/sampled_tokens/mean']:.1f}, failed {row['agent/failed']}"
        )


@pytest.fixture
def openenv_server(tmp_path: Path) -> Iterator[str]:
    """``python -m examples.agents.openenv_guess`` on a free port, until the test ends."""
    pytest.importorskip("openenv.core.env_server")
    from procs import ServiceProcess

    from rlfleet.common.redis_server import free_port

    port = free_port()
    argv = [sys.executable, "-m", "examples.agents.openenv_guess", "--port", str(port)]
    proc = ServiceProcess.start(argv, tmp_path / "openenv.log", "openenv-server")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_until(lambda: _healthy(url), 60, "serving /health")
        yield url
    finally:
        proc.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def test_an_openenv_server(tmp_path: Path, train_rows: str, openenv_server: str) -> None:
    """The typed ``EnvClient`` of a real OpenEnv server: one WebSocket session per episode."""
    rows = train(
        tmp_path,
        train_rows,
        "examples.agents.openenv_guess:GuessClient",
        f'agent.env_kwargs={{base_url: "{openenv_server}"}}',
    )
    assert all(row["agent/turns/mean"] > 1 for row in rows)
