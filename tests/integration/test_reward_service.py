"""The reward service as real processes (``python -m rlfleet.reward.main``) on a real Redis.

Covers the front doors (gRPC through RewardClient, HTTP, OpenRLHF and slime routes), per-item
errors, bad requests, local first (no Redis job while the front door's own worker is idle; a
front door killed mid-request fails the RPC, and the retry with the same ids is answered), and
crash recovery: a worker SIGKILLed mid-job leaves its entry pending, and a fresh worker-only
process reclaims and answers it. Every process started here is killed by PID in a finalizer.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from procs import ServiceProcess
from redis.exceptions import ResponseError

from rlfleet.common.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from rlfleet.common.redis_server import free_port
from rlfleet.reward.client import RewardClient, SyncRewardClient
from rlfleet.reward.service import reward_queue
from rlfleet.reward.types import ScoreRequest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_reward.py"


@dataclass
class Proc:
    """A reward process we started; ``port``/``http_port`` are 0 for worker-only ones."""

    process: ServiceProcess
    port: int = 0
    http_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:  # the tail, for failure messages and start markers
        return self.process.log()[-4000:]

    def kill(self) -> None:
        self.process.stop(signal.SIGKILL)


class Launcher:
    """Starts reward processes for one test and kills them all (by PID) at the end."""

    def __init__(self, redis_url: str, cluster: str, tmp_path: Path) -> None:
        self.redis_url, self.cluster, self.tmp_path = redis_url, cluster, tmp_path
        self.procs: list[Proc] = []

    def start(self, *overrides: str, worker_only: bool = False, flags: tuple = ()) -> Proc:
        log_path, port, http_port = self.tmp_path / f"reward-{len(self.procs)}.log", 0, 0
        args = [
            sys.executable,
            "-m",
            "rlfleet.reward.main",
            f"cluster={self.cluster}",
            f"redis_url={self.redis_url}",
            *overrides,
        ]
        if not worker_only:  # overrides first: argparse wants positionals together
            port, http_port = free_port(), free_port()
            args += [f"reward.http_port={http_port}", "--port", str(port)]
        args += [*flags, "--worker-only"] if worker_only else list(flags)
        proc = Proc(ServiceProcess.start(args, log_path, name="reward"), port, http_port)
        self.procs.append(proc)
        proc.process.wait_for_line("started" if worker_only else "listening on port", 60)
        return proc


@pytest.fixture
def launcher(redis_url, cluster_name, tmp_path) -> Iterator[Launcher]:
    launch = Launcher(redis_url, cluster_name, tmp_path)
    try:
        yield launch
    finally:
        for proc in launch.procs:
            proc.kill()


@pytest.fixture
def service(launcher) -> Proc:
    """Front doors + two in-process workers, with the example user function as default."""
    custom = (f"reward.custom.path={EXAMPLE}", "reward.custom.reward_kwargs={format_bonus: 0.5}")
    return launcher.start("reward.workers=2", *custom)


@pytest.fixture
async def client(service) -> RewardClient:
    async with RewardClient(service.address, timeout_s=30) as reward_client:
        await reward_client.wait_ready(10)
        yield reward_client


def item(i: int, answer: str, truth: str, source: str = "arith") -> ScoreRequest:
    return ScoreRequest(str(i), source, answer, truth, {"index": i})


async def test_score_and_list_scorers(client):
    result = await client.score(item(0, "42", "42"))
    assert (result.id, result.score, result.error) == ("0", 1.0, "")
    assert (await client.score(item(1, "41", "42"))).score == 0.0
    custom = await client.score(item(2, "#### 7", "7", source="gsm8k"))
    assert custom.score == 1.5 and custom.metrics == {"acc": 1.0, "formatted": 1.0, "pred": 7.0}
    scorers = {info.name: info for info in await client.list_scorers()}
    assert scorers["arith"].kind == "builtin" and scorers["arith"].data_sources == ["arith"]
    assert (scorers["compute_score"].kind, scorers["compute_score"].data_sources) == ("user", ["*"])


async def test_score_batch_preserves_order_and_reused_ids(client):
    """Two batches with the same ids and different answers: each gets its own scores."""
    for flip in (0, 1):
        requests = [item(i, str(i + (i + flip) % 2), str(i)) for i in range(512)]
        started = time.perf_counter()
        results = await client.score_batch(requests)
        elapsed = time.perf_counter() - started
        assert [r.id for r in results] == [str(i) for i in range(512)]
        assert [r.score for r in results] == [float((i + flip) % 2 == 0) for i in range(512)]
        print(f"ScoreBatch 512 arith items: {elapsed * 1000:.0f} ms, {512 / elapsed:.0f} items/s")


async def test_invalid_requests_are_rejected_and_service_keeps_serving(client):
    with pytest.raises(InvalidArgument) as caught:
        await client.score(ScoreRequest("x" * 300, "arith", "1", "1"))
    assert caught.value.__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT
    unnamed = await client.score_batch([ScoreRequest("", "arith", "1", "1")] * 2)
    assert [(r.id, r.score) for r in unnamed] == [("0", 1.0), ("1", 1.0)]  # ids are optional
    with pytest.raises(InvalidArgument, match="duplicate id"):
        await client.score_batch([item(1, "1", "1"), item(1, "2", "2")])
    with pytest.raises(InvalidArgument, match="solution_str is"):
        await client.score(item(2, "9" * ((1 << 20) + 1), "1"))
    with pytest.raises(NotFound, match="no scorer named 'nope'"):
        await client.score(ScoreRequest("3", "arith", "1", "1", scorer="nope"))
    assert (await client.score(item(4, "5", "5"))).score == 1.0


async def test_user_function_errors_are_per_item(client):
    requests = [
        item(0, "#### 3", "3", source="gsm8k"),
        item(1, "3", "three", source="gsm8k"),  # float("three") raises in the user function
        ScoreRequest("2", "arith", "3", "3", scorer="nope"),
        item(3, "3", "3"),
    ]
    results = await client.score_batch(requests)
    assert [r.error == "" for r in results] == [True, False, False, True]
    assert "raised ValueError" in results[1].error
    assert results[2].error.startswith("NotFound: no scorer named 'nope'")
    assert (results[0].score, results[3].score) == (1.5, 1.0)


def test_sync_client_then_sigterm_stops_cleanly(service):
    with SyncRewardClient(service.address) as sync:
        assert [r.score for r in sync.score_batch([item(0, "1", "1"), item(1, "0", "1")])] == [1, 0]
        assert "arith" in {info.name for info in sync.list_scorers()}
    assert service.process.stop(signal.SIGTERM, grace_s=15) == 0
    assert "stopped after" in service.log()


def test_score_cli_writes_scores_and_summary(service, tmp_path):
    rows = [
        {"data_source": "arith", "response": "12", "reward_model": {"ground_truth": "12"}},
        {"data_source": "arith", "response": "13", "reward_model": {"ground_truth": 12}},
        {
            "data_source": "gsm8k",
            "response": "#### 5",
            "reward_model": {"ground_truth": "5"},
            "extra_info": {"index": 3},
        },
        {"data_source": "gsm8k", "response": "5", "reward_model": {"ground_truth": "five"}},
        {"data_source": "arith", "text": "12", "reward_model": {"ground_truth": "12"}},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlfleet.reward.score_cli",
            "--input",
            str(src),
            "--output",
            str(dst),
            "--address",
            service.address,
            "--batch-size",
            "2",
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr  # rows failed
    assert "2 rows failed" in done.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [row["score"] for row in out] == [1.0, 0.0, 1.5, 0.0, 0.0]
    assert out[2]["score_metrics"]["acc"] == 1.0 and out[2]["extra_info"] == {"index": 3}
    assert "raised ValueError" in out[3]["score_error"]
    assert "no 'response' field" in out[4]["score_error"]
    assert "5 rows: mean score 0.8333 over 3 scored, 2 errors" in done.stdout


def http(proc: Proc, method: str, path: str, body: object = None, key: str | None = None):
    """(status, JSON body) of one HTTP call, retrying briefly while the server starts."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        f"http://127.0.0.1:{proc.http_port}{path}", data, headers, method=method
    )
    for _ in range(50):
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
        except urllib.error.URLError:
            time.sleep(0.1)
    raise AssertionError("HTTP server never answered")


def test_http_front_door(service):
    assert http(service, "GET", "/healthz") == (200, {"status": "ok"})
    one = {"id": "a", "data_source": "arith", "solution_str": "12", "ground_truth": "12"}
    assert http(service, "POST", "/score", one) == (
        200,
        {"id": "a", "score": 1.0, "metrics": {}, "error": ""},
    )
    two = {"requests": [one, {**one, "id": "b", "solution_str": "1"}]}
    status, body = http(service, "POST", "/score_batch", two)
    assert status == 200 and [r["score"] for r in body["results"]] == [1.0, 0.0]
    status, body = http(service, "GET", "/scorers")
    assert http(service, "GET", "/v1/scorers") == (status, body)  # the versioned names too
    assert http(service, "POST", "/v1/score/batch", two)[0] == 200
    assert http(service, "POST", "/v1/score", one)[0] == 200
    status, spec = http(service, "GET", "/openapi.json")  # typed bodies: every field shown
    body_schema = spec["paths"]["/v1/score/batch"]["post"]["requestBody"]["content"]
    item = body_schema["application/json"]["schema"]["properties"]["requests"]["items"]
    assert {"id", "data_source", "solution_str", "ground_truth", "extra_info"} <= set(
        item["properties"]
    )
    assert status == 200 and {"arith", "compute_score", "math"} <= {
        s["name"] for s in body["scorers"]
    }
    status, body = http(service, "POST", "/score", {**one, "id": "x" * 300})
    assert status == 400 and "id must be" in body["error"]
    assert http(service, "POST", "/score", {**one, "id": None})[1]["id"] == "0"
    assert http(service, "POST", "/score", {**one, "scorer": "nope"})[0] == 404
    assert http(service, "POST", "/score", one)[0] == 200


def test_api_key_guards_grpc_and_http(launcher):
    proc = launcher.start("api_key=s3cret")
    with SyncRewardClient(proc.address) as anonymous, pytest.raises(Unauthenticated):
        anonymous.list_scorers()
    with SyncRewardClient(proc.address, api_key="s3cret") as keyed:
        assert keyed.score(item(0, "2", "2")).score == 1.0
    one = {"id": "a", "data_source": "arith", "solution_str": "2", "ground_truth": "2"}
    assert [http(proc, "POST", "/score", one, key)[0] for key in (None, "x", "s3cret")] == [
        401,
        401,
        200,
    ]
    assert http(proc, "GET", "/healthz")[0] == 200


TEST_SCORER = """
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, calls_file="",
                  sleep_s=0, hold_file=""):
    with open(calls_file, "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    time.sleep(float(sleep_s))
    while os.path.exists(hold_file):  # the test removes it once this worker has been killed
        time.sleep(0.05)
    return float(solution_str == ground_truth)
"""


def user_scorer(tmp_path: Path, **kwargs: object) -> tuple[str, ...]:
    """Overrides loading TEST_SCORER as the user function, with ``kwargs`` as reward_kwargs."""
    path = tmp_path / "user_scorer.py"
    path.write_text(TEST_SCORER)
    pairs = ", ".join(f"{key}: '{value}'" for key, value in kwargs.items())
    # threads, not the sandbox: it writes calls_file outside any sandbox dir (sandboxed
    # recovery: test_reward_sandbox.py)
    return (
        f"reward.custom.path={path}",
        f"reward.custom.reward_kwargs={{{pairs}}}",
        "reward.sandbox=false",
    )


async def test_job_of_killed_worker_is_reclaimed(launcher, redis_client, keys, tmp_path):
    (hold := tmp_path / "hold").touch()
    custom = user_scorer(tmp_path, hold_file=hold, calls_file=tmp_path / "calls")
    flags = ("--reclaim-idle-s", "1", "--item-timeout-s", "60")
    front = launcher.start("reward.workers=0", *custom)
    doomed = launcher.start(*custom, worker_only=True, flags=flags)
    async with RewardClient(front.address, timeout_s=60) as reward_client:
        call = asyncio.create_task(reward_client.score(item(0, "9", "9", source="x")))
        queue = reward_queue(redis_client, keys)
        async with asyncio.timeout(10):
            while await queue.pending_count() == 0:  # until the doomed worker holds the job
                await asyncio.sleep(0.05)
        doomed.kill()  # SIGKILL while the job is held inside the user function
        hold.unlink()
        assert not call.done()
        launcher.start(*custom, worker_only=True, flags=flags)
        result = await asyncio.wait_for(call, 30)
    assert (result.score, result.error) == (1.0, "")


async def test_slow_job_is_not_reclaimed_from_a_live_worker(launcher, tmp_path):
    """A job running longer than the reclaim delay stays with its (live) worker: run once."""
    calls = tmp_path / "calls"
    custom = user_scorer(tmp_path, calls_file=calls, sleep_s=2)
    flags = ("--reclaim-idle-s", "0.6")
    front = launcher.start("reward.workers=0", *custom)
    for _ in range(2):
        launcher.start(*custom, worker_only=True, flags=flags)
    async with RewardClient(front.address, timeout_s=30) as reward_client:
        result = await reward_client.score(item(0, "1", "1", source="x"))
    assert (result.score, result.error) == (1.0, "")
    assert len(calls.read_text().split()) == 1


def test_openrlhf_and_slime_routes(service):
    """Both use reward.default_scorer (math) when the body names no data source."""
    body = {
        "query": ["Q? \\boxed{4}", "Q? \\boxed{5}"],
        "prompts": ["Q?", "Q?"],
        "labels": ["4", "4"],
    }
    status, reply = http(service, "POST", "/get_reward", body)
    assert status == 200 and reply["rewards"] == [1.0, 0.0] == reply["scores"]
    assert reply["extra_logs"]["acc"] == [1.0, 0.0]
    one = {"prompt": "Q?", "response": "so \\boxed{\\frac{1}{2}}", "label": "0.5"}
    assert http(service, "POST", "/slime/reward", one) == (200, 1.0)
    detail = http(service, "POST", "/slime/reward?detail=true", {**one, "label": "3"})
    assert detail == (200, {"score": 0.0, "metrics": {"acc": 0.0, "boxed": 1.0}})
    gsm8k = {"response": "#### 7", "label": 7, "data_source": "openai/gsm8k"}
    assert http(service, "POST", "/slime/reward", gsm8k) == (200, 1.5)  # the user default's
    assert http(service, "POST", "/get_reward", {"query": "x"})[0] == 400


async def stream_entries(redis_client, keys) -> int:
    """Entries ever added to the reward stream of this test's cluster."""
    try:
        return int((await redis_client.xinfo_stream(keys.reward_stream))["entries-added"])
    except ResponseError:  # no stream: nothing was ever queued
        return 0


@pytest.mark.parametrize("local_first", [True, False])
async def test_local_first_skips_redis_while_the_own_worker_is_idle(
    launcher, redis_client, keys, local_first
):
    proc = launcher.start("reward.workers=1", f"reward.local_first={str(local_first).lower()}")
    requests = [item(i, str(i), str(i)) for i in range(256)]
    async with RewardClient(proc.address, timeout_s=30) as reward_client:
        results = await reward_client.score_batch(requests)
    assert [r.score for r in results] == [1.0] * 256
    assert await stream_entries(redis_client, keys) == (0 if local_first else 1)  # one job


async def test_a_local_request_dies_with_its_process_and_its_retry_is_answered(launcher, tmp_path):
    (hold := tmp_path / "hold").touch()
    calls = tmp_path / "calls"
    custom = user_scorer(tmp_path, hold_file=hold, calls_file=calls)
    doomed = launcher.start("reward.workers=1", *custom)
    batch = [item(0, "9", "9", source="x"), item(1, "8", "9", source="x")]
    async with RewardClient(doomed.address, timeout_s=30) as reward_client:
        call = asyncio.create_task(reward_client.score_batch(batch))
        async with asyncio.timeout(20):
            while not calls.exists():  # scoring has started, in the front door's process
                await asyncio.sleep(0.05)
        doomed.kill()
        with pytest.raises(Unavailable):
            await call
    hold.unlink()
    retry = launcher.start("reward.workers=1", *custom)
    async with RewardClient(retry.address, timeout_s=30) as reward_client:
        results = await reward_client.score_batch(batch)
    assert [(r.id, r.score, r.error) for r in results] == [("0", 1.0, ""), ("1", 0.0, "")]
