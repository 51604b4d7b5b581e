"""The reward sandbox contains what user code does: each case is an item error, never a hang,
a crashed service, a file outside the sandbox, a connection, or a leaked secret.

Real child processes, no mocks. The user function below picks its misbehaviour from the
response text, so one pool serves every case and must keep serving after each.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from rlfleet.common.config import SandboxLimits, UserScorerConfig
from rlfleet.common.sandbox import run_program
from rlfleet.common.sandbox.parent import describe_exit, describe_isolation
from rlfleet.common.sandbox.scrub import scrub, scrub_tree
from rlfleet.reward.sandbox_pool import SandboxPool, close_scorer, sandboxed_user_scorer
from rlfleet.reward.scorers.code import code_scorer, parse_tests, solution_of
from rlfleet.reward.types import ScoreRequest

LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2.0, memory_mb=512, file_size_mb=1, workers=2)

USER_FUNCTION = """
import os, socket, subprocess, sys, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    what, arg = solution_str, (extra_info or {}).get("arg", "")
    if what == "loop":
        while True:
            pass
    if what == "sleep":
        time.sleep(float(arg))
    if what == "fork":
        while True:
            os.fork()
    if what == "spawn":
        subprocess.run(["sleep", "100"])
    if what == "hog":
        hoard = [bytearray(64 << 20) for _ in range(64)]
    if what == "write":
        with open(arg, "w") as f:
            f.write("escaped")
    if what == "write_here":
        with open("inside.txt", "w") as f:
            f.write("fine")
    if what == "remove":
        os.remove(arg)
    if what == "socket":
        socket.create_connection(("127.0.0.1", int(arg)), timeout=1).close()
    if what == "secret":
        return float(os.environ["RLFLEET_API_KEY"] == "s3cret")
    if what == "crash":
        os._exit(3)
    if what == "kill_parent":
        os.kill(os.getppid(), 9)
    if what == "big_file":
        with open("big.bin", "wb") as f:
            f.write(b"x" * (4 << 20))
    return float(solution_str == str(ground_truth))
"""


def request(what: str, arg: object = "", truth: str = "ok") -> ScoreRequest:
    return ScoreRequest("1", "custom", what, truth, {"arg": str(arg)})


@pytest.fixture
async def scorer(tmp_path: Path):
    path = tmp_path / "misbehaving.py"
    path.write_text(USER_FUNCTION)
    user = await sandboxed_user_scorer(UserScorerConfig(path=str(path)), LIMITS)
    try:
        yield user
    finally:
        await close_scorer(user)


async def score(scorer, what: str, arg: object = "") -> tuple[float, str]:
    [result] = await scorer.ascore_many([request(what, arg)])
    return result.score, result.error


async def still_serving(scorer) -> None:
    assert await score(scorer, "ok") == (1.0, "")


async def test_a_plain_call_and_what_the_child_reports(scorer):
    await still_serving(scorer)
    assert scorer.pool.about["batched"] is False
    assert isinstance(scorer.pool.about["network_isolated"], bool)


async def test_infinite_loop_is_killed_and_its_worker_replaced(scorer):
    _, error = await score(scorer, "loop")
    assert "timed out after 2s" in error and "replaced" in error
    assert scorer.pool.replaced == 1
    await still_serving(scorer)


@pytest.mark.parametrize("what", ["fork", "spawn"])
async def test_new_processes_are_refused(scorer, what):
    _, error = await score(scorer, what)
    assert "is not allowed" in error
    await still_serving(scorer)


async def test_memory_hog_fails_its_item(scorer):
    _, error = await score(scorer, "hog")
    assert "MemoryError" in error
    await still_serving(scorer)


async def test_writes_outside_the_sandbox_dir_are_refused(scorer, tmp_path):
    target = tmp_path / "escaped.txt"
    _, error = await score(scorer, "write", target)
    assert "outside the sandbox dir" in error and not target.exists()
    (keep := tmp_path / "keep.txt").write_text("mine")
    assert "outside the sandbox dir" in (await score(scorer, "remove", keep))[1]
    assert keep.exists()
    assert (await score(scorer, "write_here"))[1] == ""  # its own directory is writable


async def test_file_size_limit(scorer):
    _, error = await score(scorer, "big_file")
    assert "File too large" in error or "EFBIG" in error


async def test_no_network(scorer):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        _, error = await score(scorer, "socket", server.getsockname()[1])
        assert "socket" in error
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected


async def test_environment_secrets_are_not_passed(scorer, monkeypatch):
    monkeypatch.setenv("RLFLEET_API_KEY", "s3cret")  # children started from now on
    await scorer.pool.close()
    scorer.pool = SandboxPool(UserScorerConfig(path=scorer.pool.user["path"]), LIMITS)
    await scorer.pool.start()
    _, error = await score(scorer, "secret")
    assert "KeyError('RLFLEET_API_KEY')" in error


async def test_crash_and_signalling_the_parent(scorer):
    _, error = await score(scorer, "crash")
    assert "exited with code 3" in error
    _, error = await score(scorer, "kill_parent")
    assert "os.kill is not allowed" in error
    await still_serving(scorer)


async def test_a_cancelled_call_kills_its_child_and_holds_nothing(scorer):
    busy = [asyncio.create_task(score(scorer, "sleep", 30)) for _ in range(3)]  # 1 waits
    async with asyncio.timeout(10):
        while scorer.pool.calls < 2:  # two calls hold a child each; the third waits for one
            await asyncio.sleep(0.01)
    for task in busy:
        task.cancel()
    await asyncio.gather(*busy, return_exceptions=True)
    assert scorer.pool.replaced == 2  # the two running were killed; the waiter held nothing
    async with asyncio.timeout(10):
        await still_serving(scorer)


async def test_a_function_that_does_not_load_fails_the_start(tmp_path):
    (bad := tmp_path / "bad.py").write_text("raise RuntimeError('broken import')\n")
    with pytest.raises(ValueError, match="broken import"):
        await sandboxed_user_scorer(UserScorerConfig(path=str(bad)), LIMITS)


async def test_program_runs_are_contained():
    assert (await run_program("print(input())", "hi\n", LIMITS)).stdout == "hi\n"
    looping = await run_program("while True: pass", "", LIMITS)
    assert not looping.ok and ("timed out" in looping.reason or "CPU" in looping.reason)
    forking = await run_program("import os\nwhile True: os.fork()", "", LIMITS)
    assert forking.returncode == 1 and "os.fork is not allowed" in forking.stderr
    flood = await run_program("while True: print('x' * 1000)", "", LIMITS)
    assert "output over" in flood.reason
    env = await run_program("import os; print(sorted(os.environ))", "", LIMITS)
    assert "RLFLEET" not in env.stdout and "PATH" in env.stdout


def test_code_ground_truth_shapes():
    assert solution_of("text\n```python\nx = 1\n```\nmore") == "x = 1\n"
    assert parse_tests('{"tests": ["assert 1"]}') == {"tests": ["assert 1"]}
    assert parse_tests({"inputs": ["1"], "outputs": [2]}) == {"inputs": ["1"], "outputs": ["2"]}
    with pytest.raises(ValueError, match="1 inputs but 2 outputs"):
        parse_tests({"inputs": ["1"], "outputs": ["1", "2"]})


async def test_code_scorer_counts_passed_tests():
    scorer = code_scorer(LIMITS)
    asserts = {"tests": ["assert f(1) == 2", "assert f(2) == 5", "assert f(3) == 4"]}
    solution = "```python\ndef f(x):\n    return x + 1\n```"
    [result] = await scorer.ascore_many([ScoreRequest("a", "code", solution, asserts)])
    assert result.score == pytest.approx(2 / 3) and result.metrics == {"passed": 2, "tests": 3}
    stdio = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3", "10"]}
    adder = "a, b = map(int, input().split())\nprint(a + b)"
    [result] = await scorer.ascore_many([ScoreRequest("b", "code", adder, stdio)])
    assert result.score == 1.0
    cheat = "import sys\nsys.exit(0)"  # ending early must not pass an assert test
    [result] = await scorer.ascore_many([ScoreRequest("c", "code", cheat, asserts)])
    assert result.score == 0.0
    [result] = await code_scorer(LIMITS, "all").ascore_many(
        [ScoreRequest("d", "code", solution, asserts)]
    )
    assert result.score == 0.0


def test_scrub_takes_every_secret_value_out(monkeypatch):
    monkeypatch.setenv("RLFLEET_API_KEY", "k3y-value")
    monkeypatch.setenv("CACHE_URL", "redis://user:pw@host:6379/0")
    monkeypatch.setenv("RLFLEET_CLUSTER", "default")  # not a secret: stays
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # nor this
    argv = ["rlfleet", "api_key=argv-value", "--auth-token", "flag-value", "reward.workers=2"]
    monkeypatch.setattr(sys, "argv", argv)
    said = "k3y-value argv-value flag-value redis://user:pw@host:6379/0 default false 2"
    assert scrub(said) == "[redacted] [redacted] [redacted] [redacted] default false 2"
    reply = {"results": [{"error": "raised k3y-value", "score": 0.0, "metrics": {"flag-value": 1}}]}
    assert scrub_tree(reply) == {
        "results": [{"error": "raised [redacted]", "score": 0.0, "metrics": {"[redacted]": 1}}]
    }


def test_what_the_log_says_of_the_kernel_layers():
    full = {
        "namespaces": ["pid", "mount", "net", "ipc", "uts"],
        "fallback": "",
        "cgroup": True,
        "readonly": True,
        "proc": "own",
        "capabilities": False,
    }
    line = describe_isolation(full)
    assert "pid+mount+net+ipc+uts" in line and "FALLBACK" not in line
    assert "read-only filesystem: yes" in line and "capabilities dropped: yes" in line
    bare = {"namespaces": [], "fallback": "unshare(pid+mount): Operation not permitted"}
    assert "FALLBACK" in describe_isolation(bare) and "not permitted" in describe_isolation(bare)
    assert describe_exit(-9).startswith("killed") and describe_exit(-99) == "ended by signal 99"
