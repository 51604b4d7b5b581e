"""Fair scoring inside a process, and idle detection on every server (issue 19, part 2).

- Lanes go round-robin among owners: a 1-item owner is served next, not after 20 others.
- Without a sandbox, calls that hang are abandoned at their timeout: after more stuck calls
  than there are threads, a good item is still scored (it used to time out behind them), and
  built-ins never wait for user functions.
- ``IdleWorkers`` counts workers blocked on an empty stream on Valkey *and* Redis 7.0, whose
  ``XINFO CONSUMERS idle`` never counted them.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis.asyncio as aioredis
from redis_servers import any_redis_url, redis_kind_server  # noqa: F401 - fixtures

from rlfleet.common.config import RewardConfig
from rlfleet.common.jobs import IdleWorkers, JobWorker, JobWorkerPool
from rlfleet.common.keys import Keys
from rlfleet.common.workqueue import Job, WorkQueue
from rlfleet.reward.batch_scorer import USER_THREADS, BatchScorer
from rlfleet.reward.lanes import FairLanes, StuckCalls, ThreadLanes, owned_by
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.scorers.base import Scorer
from rlfleet.reward.types import ScoreRequest

RELEASE = threading.Event()  # stuck calls of this module end when it is set


async def test_lanes_serve_owners_in_turn() -> None:
    lanes, order = FairLanes(1), []

    async def item(owner: str, index: int) -> None:
        with owned_by(owner):
            async with lanes.lane():
                order.append(owner)
                await asyncio.sleep(0.001)

    big = [asyncio.create_task(item("big", i)) for i in range(20)]
    await asyncio.sleep(0)  # the big batch is in line first
    small = asyncio.create_task(item("small", 0))
    await asyncio.gather(*big, small)
    assert order.index("small") <= 2, order


async def test_a_cancelled_waiter_gives_up_its_turn() -> None:
    lanes = FairLanes(1)
    async with lanes.lane():
        waiting = asyncio.create_task(_take(lanes))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.wait_for(_take(lanes), 1)  # the lane is free, not lost to the cancelled one
    assert lanes.free == 1


async def _take(lanes: FairLanes) -> None:
    async with lanes.lane():
        pass


async def test_thread_lanes_abandon_stuck_calls_and_keep_serving() -> None:
    lanes = ThreadLanes(2, max_abandoned=5)
    for _ in range(4):  # twice as many stuck calls as lanes
        with pytest.raises(TimeoutError):
            await lanes.call(lambda: RELEASE.wait(60), 0.05)
    assert await lanes.call(lambda: 42, 1) == 42
    assert lanes.abandoned == 4
    with pytest.raises(TimeoutError):
        await lanes.call(lambda: RELEASE.wait(60), 0.05)
    with pytest.raises(StuckCalls):  # a function that hangs on everything costs no more threads
        await lanes.call(lambda: 1, 1)


def _hangs_on_request(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        RELEASE.wait(60)
    return float(solution_str == ground_truth)


def unthreaded_user(tmp_path) -> BatchScorer:
    """A registry whose default is a user function run in threads (``sandbox: false``)."""
    registry = build_registry(RewardConfig())
    user = Scorer(name="hangs", kind="user", fn=_hangs_on_request, blocking=True)
    registry.add(user, default=True)
    return BatchScorer(registry, item_timeout_s=0.3)


async def test_more_stuck_items_than_threads_still_leave_the_service_scoring(tmp_path):
    engine = unthreaded_user(tmp_path)
    stuck = [ScoreRequest(f"h{i}", "mine", "hang", "x") for i in range(USER_THREADS + 2)]
    results = await engine.score_all(stuck)
    assert all("timed out" in r.error for r in results)
    started = time.perf_counter()
    good, builtin = await engine.score_all(
        [ScoreRequest("ok", "mine", "7", "7"), ScoreRequest("b", "x", "3", "3", scorer="arith")]
    )
    assert (good.error, good.score, builtin.score) == ("", 1.0, 1.0)
    assert time.perf_counter() - started < 0.3 * 0.9  # no wait for a stuck thread's timeout


async def test_builtins_never_wait_for_a_stuck_user_function(tmp_path):
    engine = unthreaded_user(tmp_path)
    hung = asyncio.create_task(engine.score_all([ScoreRequest("h", "mine", "hang", "x")] * 8))
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    math = ScoreRequest("m", "x", "\\boxed{2}", "2", scorer="math")  # a blocking built-in
    (result,) = await engine.score_all([math])
    assert result.score == 1.0 and time.perf_counter() - started < 0.25
    await hung


class Blocked(JobWorker):
    async def handle(self, job: Job) -> bytes:
        await asyncio.sleep(30)
        return b""


async def test_idle_workers_sees_blocked_readers_on_every_server(any_redis_url):  # noqa: F811
    client = aioredis.Redis.from_url(any_redis_url)
    keys = Keys("idle")
    queue = WorkQueue(client, keys, keys.reward_stream, "reward")
    pool = JobWorkerPool(lambda: None, stop_after_s=0.1)
    try:
        await queue.ensure_group()
        for name in ("one", "two"):
            pool.add(Blocked(queue, name, read_block_ms=200))
        idle = IdleWorkers(queue, cache_s=0)
        await asyncio.sleep(3.5)  # longer than fresh_ms: block-reads that got nothing
        assert await idle.count() == 2
        await queue.submit("r1", b"work")
        await _until(lambda: _count_is(idle, 1))  # the one holding the job is busy
    finally:
        await pool.stop()
        await client.aclose()


async def _count_is(idle: IdleWorkers, expected: int) -> bool:
    return await idle.count() == expected


async def _until(check, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@pytest.fixture(autouse=True, scope="module")
def _release_stuck_threads():
    yield
    RELEASE.set()
