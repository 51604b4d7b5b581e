"""The Tinker API's futures and per-client order (rlfleet.trainer.tinker.futures, .gate)."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.common.errors import NotFound
from rlfleet.trainer.tinker.futures import Done, Failed, Futures, Pending
from rlfleet.trainer.tinker.gate import SeqGate


async def test_a_repeated_key_gets_the_same_request_and_runs_once() -> None:
    futures, runs = Futures(wait_s=1.0), []

    async def work() -> int:
        runs.append(1)
        return 42

    first, started = futures.submit("model:1", work)
    again, started_again = futures.submit("model:1", work)
    assert (first, started, started_again) == (again, True, False)
    assert await futures.retrieve(first) == Done(42)
    assert await futures.retrieve(first) == Done(42)  # a repeated poll is answered again
    assert runs == [1]


async def test_pending_then_failed_and_unknown() -> None:
    futures, release = Futures(wait_s=0.01), asyncio.Event()

    async def work() -> None:
        await release.wait()
        raise ValueError("bad datum")

    request_id, _ = futures.submit(None, work)
    assert await futures.retrieve(request_id) == Pending()
    release.set()
    outcome = await futures.retrieve(request_id, wait_s=1.0)
    assert isinstance(outcome, Failed) and "bad datum" in str(outcome.error)
    with pytest.raises(NotFound):
        await futures.retrieve("req-999")


async def test_oldest_answers_expire_past_the_limit() -> None:
    futures = Futures(kept=2, wait_s=1.0)

    async def work() -> str:
        return "x"

    ids = [futures.submit(f"k{i}", work)[0] for i in range(3)]
    for request_id in ids:
        await futures.retrieve(request_id)
    assert not futures.known(ids[0]) and futures.known(ids[2])


async def test_calls_run_in_seq_order_whatever_order_they_arrive_in() -> None:
    gate, ran = SeqGate(), []

    async def call(seq: int) -> None:
        async with gate.turn(seq):
            ran.append(seq)
            await asyncio.sleep(0)

    await asyncio.gather(call(3), call(2), call(4), call(1))
    assert ran == [1, 2, 3, 4]


async def test_a_refused_call_does_not_hold_the_next() -> None:
    gate, ran = SeqGate(), []

    async def call(seq: int) -> None:
        async with gate.turn(seq):
            ran.append(seq)

    waiting = asyncio.create_task(call(2))
    await gate.skip(1)  # call 1 was refused at the door
    await asyncio.wait_for(waiting, 1.0)
    assert ran == [2]
