"""The reward service with its sandbox, cancellation and standalone start, as real processes.

- Containment through gRPC: each misbehaving item is an error with ``reward.default_score``,
  the rest of the batch is scored, and the service keeps serving (and counts it in /metrics).
- Cancellation: a caller that times out stops its work, in-process and through the queue (its
  unread jobs leave the stream), so the next caller is served at once.
- A worker SIGKILLed mid-batch: its sandboxed children die with it, its job is taken over, and
  every item is answered once.
- ``rlfleet reward`` with no Redis configured starts its own, writes ``endpoints.json``, serves
  /metrics, and stops it all on SIGTERM. The Python client refuses wrong types before sending.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from procs import ServiceProcess, clean_env

from rlfleet.common.errors import DeadlineExceeded, InvalidArgument
from rlfleet.common.redis_server import free_port
from rlfleet.reward.client import RewardClient, SyncRewardClient
from rlfleet.reward.service import reward_queue
from rlfleet.reward.types import ScoreRequest

pytestmark = pytest.mark.slow

USER_FUNCTION = """
import os, socket, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, hold_file=""):
    what = solution_str
    if what == "loop":
        while True:
            pass
    if what == "fork":
        while True:
            os.fork()
    if what == "hog":
        hoard = [bytearray(64 << 20) for _ in range(64)]
    if what == "write":
        open(ground_truth, "w").write("escaped")
    if what == "socket":
        socket.create_connection(("127.0.0.1", int(ground_truth)), timeout=1)
    if what == "secret":
        return float(os.environ["MY_SECRET_TOKEN"] == "s3cret")
    if what == "slow":
        time.sleep(0.5)
    while hold_file and os.path.exists(hold_file):  # until the test lets go
        time.sleep(0.05)
    return float(solution_str == str(ground_truth))
"""


class Services:
    """Reward processes of one test, each stopped (by its PID and group) at the end."""

    def __init__(self, redis_url: str, cluster: str, tmp_path: Path) -> None:
        self.redis_url, self.cluster, self.tmp_path = redis_url, cluster, tmp_path
        self.function = tmp_path / "user_function.py"
        self.function.write_text(USER_FUNCTION)
        self.procs: list[ServiceProcess] = []

    def start(self, *overrides: str, worker_only: bool = False, **env: str) -> tuple:
        """(process, gRPC address, HTTP port) of a new reward process."""
        port, http_port = free_port(), free_port()
        args = [
            sys.executable,
            "-m",
            "rlfleet.reward.main",
            f"cluster={self.cluster}",
            f"redis_url={self.redis_url}",
            f"reward.custom.path={self.function}",
            "reward.sandbox_limits.timeout_s=3",
            "reward.sandbox_limits.memory_mb=768",
            *overrides,
        ]
        args += (
            ["--worker-only", "--reclaim-idle-s", "1"]
            if worker_only
            else [f"reward.http_port={http_port}", "--port", str(port)]
        )
        log = self.tmp_path / f"reward-{len(self.procs)}.log"
        proc = ServiceProcess.start(
            args, log, "reward", clean_env(RLFLEET_RUN_DIR=str(self.tmp_path), **env)
        )
        self.procs.append(proc)
        proc.wait_for_line("started" if worker_only else "listening on port", 90)
        return proc, f"127.0.0.1:{port}", http_port


@pytest.fixture
def services(redis_url, cluster_name, tmp_path) -> Iterator[Services]:
    started = Services(redis_url, cluster_name, tmp_path)
    try:
        yield started
    finally:
        for proc in started.procs:
            proc.stop(signal.SIGKILL)


def item(i: int, what: str, truth: object = "") -> ScoreRequest:
    return ScoreRequest(str(i), "custom", what, truth if truth != "" else what)


def metrics(http_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as reply:
        return reply.read().decode()


async def test_misbehaving_items_are_contained_and_scored_as_default(services, tmp_path):
    _, address, http_port = services.start(
        "reward.default_score=-1", "reward.workers=1", MY_SECRET_TOKEN="s3cret"
    )
    escaped, listener = tmp_path / "escaped.txt", socket.create_server(("127.0.0.1", 0))
    bad = [
        item(0, "loop"),
        item(1, "fork"),
        item(2, "hog"),
        item(3, "write", str(escaped)),
        item(4, "socket", str(listener.getsockname()[1])),
        item(5, "secret"),
    ]
    good = [item(6, "a"), item(7, "b", "c")]
    async with RewardClient(address, timeout_s=60) as client:
        results = await client.score_batch(bad + good)
        assert [(r.score, bool(r.error)) for r in results] == [(-1.0, True)] * 6 + [
            (1.0, False),
            (0.0, False),
        ]
        assert "timed out" in results[0].error and "MemoryError" in results[2].error
        assert all("not allowed" in r.error or "outside" in r.error for r in results[1:5:2])
        assert "socket" in results[4].error and "KeyError" in results[5].error
        assert not escaped.exists()
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
        listener.close()
        assert (await client.score(item(8, "still"))).score == 1.0
    text = metrics(http_port)
    assert "rlfleet_reward_item_errors_total 6.0" in text
    assert 'rlfleet_reward_items_total{path="local"} 9.0' in text


async def served_quickly(address: str) -> None:
    """The next caller is answered within a few seconds (nothing left scoring ahead of it)."""
    async with RewardClient(address, timeout_s=5) as client:
        assert (await client.score(item(99, "fast"))).score == 1.0


@pytest.mark.parametrize("path", ["local", "queued"])
async def test_a_caller_that_times_out_stops_its_work(services, redis_client, keys, path):
    """40 slow items on 2 sandboxed processes need ~10 s; the caller gives up after 1.5 s."""
    front, address, http_port = services.start(f"reward.workers={int(path == 'local')}")
    if path == "queued":
        services.start(worker_only=True)
    async with RewardClient(address, timeout_s=1.5) as client:
        with pytest.raises(DeadlineExceeded):
            await client.score_batch([item(i, "slow") for i in range(40)])
    await served_quickly(address)
    queue = reward_queue(redis_client, keys)
    assert await queue.length() == 0
    assert "rlfleet_reward_cancelled_total 1.0" in metrics(http_port)


async def test_unread_jobs_of_a_gone_caller_leave_the_stream(services, redis_client, keys):
    _, address, _ = services.start("reward.workers=0")  # and no worker anywhere
    queue = reward_queue(redis_client, keys)
    async with RewardClient(address, timeout_s=1) as client:
        with pytest.raises(DeadlineExceeded):
            await client.score_batch([item(i, "x") for i in range(4)])
    async with asyncio.timeout(10):
        while await queue.length():
            await asyncio.sleep(0.05)


def process_table() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) for every process we can see."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        table[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    return table


def sandbox_children(parent: int) -> list[int]:
    """PIDs of the sandboxes ``parent`` started, and of every process below them (each
    sandbox is a keeper, an init and a worker)."""
    table = process_table()
    found = [
        pid
        for pid, (ppid, cmd) in table.items()
        if ppid == parent and b"rlfleet.common.sandbox.child" in cmd
    ]
    for pid in found:  # grows as it goes: breadth first
        found += [child for child, (ppid, _) in table.items() if ppid == pid]
    return found


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


async def test_worker_killed_mid_batch_every_item_answered_once(
    services, redis_client, keys, tmp_path
):
    (hold := tmp_path / "hold").touch()
    kwargs = f"reward.custom.reward_kwargs={{hold_file: '{hold}'}}"
    _, address, _ = services.start("reward.workers=0", kwargs)
    doomed, _, _ = services.start(kwargs, worker_only=True)
    children = sandbox_children(doomed.pid)
    assert len(children) >= 2, "the worker runs its user function in sandboxed processes"
    batch = [item(i, str(i % 3), "1") for i in range(6)]
    async with RewardClient(address, timeout_s=60) as client:
        call = asyncio.create_task(client.score_batch(batch))
        queue = reward_queue(redis_client, keys)
        async with asyncio.timeout(20):
            while await queue.pending_count() == 0:  # the doomed worker holds the job
                await asyncio.sleep(0.05)
        doomed.kill()
        async with asyncio.timeout(10):
            while not all(gone(pid) for pid in children):  # they die with their parent
                await asyncio.sleep(0.05)
        hold.unlink()
        services.start(kwargs, worker_only=True)
        results = await asyncio.wait_for(call, 40)
    assert [r.id for r in results] == [str(i) for i in range(6)]
    assert [r.score for r in results] == [float(i % 3 == 1) for i in range(6)]


def test_standalone_reward_starts_its_own_redis_and_records_endpoints(tmp_path):
    port, http_port = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "reward",
        f"reward.port={port}",
        f"reward.http_port={http_port}",
    ]
    proc = ServiceProcess.start(argv, tmp_path / "reward.log", "reward")
    try:
        endpoints = tmp_path / "endpoints.json"
        proc.wait_until(lambda: endpoints.exists(), 90, "writing endpoints.json")
        reward = json.loads(endpoints.read_text())["reward"]
        assert reward["grpc"] == f"127.0.0.1:{port}"
        assert reward["http"] == f"http://127.0.0.1:{http_port}"
        assert "rlfleet reward: grpc=" in proc.log() and "embedded Redis at" in proc.log()
        redis_url = reward["redis"]
        with SyncRewardClient(reward["grpc"]) as client:
            assert (
                client.score(
                    {"data_source": "arith", "solution_str": "3", "ground_truth": "3"}
                ).score
                == 1.0
            )
            with pytest.raises(TypeError, match="takes a ScoreRequest"):
                client.score(["arith", "3"])
            with pytest.raises(InvalidArgument, match="solution_str must be a string, got int"):
                client.score_batch([ScoreRequest("a", "arith", 3)])  # type: ignore[arg-type]
        assert "rlfleet_reward_items_total" in metrics(http_port)
        assert proc.stop(signal.SIGTERM, grace_s=20) == 0
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
    finally:
        proc.stop(signal.SIGKILL)
