"""Fair scoring inside a process (issue 19, part 2); idle detection on every server is in
tests/integration/test_reward_idle_workers.py.

- Lanes go round-robin among owners: a 1-item owner is served next, not after 20 others.
- Without a sandbox, calls that hang are abandoned at their timeout: after more stuck calls
  than there are threads, a good item is still scored (it used to time out behind them), and
  built-ins never wait for user functions.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlfleet.common.config import RewardConfig
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


@pytest.fixture(autouse=True, scope="module")
def _release_stuck_threads():
    yield
    RELEASE.set()
