"""``retry_transient``: transient errors are retried within the budget, the first one always;
other errors end at once."""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from rlfleet.trainer import retry


def attempts_failing(errors: list[Exception], budget_s: float) -> tuple[object, list[int]]:
    calls: list[int] = []

    async def attempt(n: int) -> str:
        calls.append(n)
        if n < len(errors):
            raise errors[n]
        return "done"

    return asyncio.run(retry.retry_transient(attempt, budget_s, "test")), calls


def test_transient_errors_are_retried_until_an_answer(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE_S", 0.01)
    result, calls = attempts_failing([Unavailable("down"), DeadlineExceeded("late")], 30)
    assert result == "done" and calls == [0, 1, 2]


def test_a_first_failure_that_outlasted_the_budget_still_gets_one_retry(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE_S", 0.01)
    result, calls = attempts_failing([DeadlineExceeded("waited out the router")], 0.0)
    assert result == "done" and calls == [0, 1]
    with pytest.raises(DeadlineExceeded):
        attempts_failing([DeadlineExceeded("a"), DeadlineExceeded("b")], 0.0)


def test_other_errors_end_at_once():
    with pytest.raises(InvalidArgument):
        attempts_failing([InvalidArgument("bad")], 30)
