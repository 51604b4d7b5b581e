"""Pure helpers of the rollout engines: batching plans, stop strings, update validation."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlfleet.common.errors import InvalidArgument
from rlfleet.rollout.engines.base import check_state_dict, cut_at_stop, tokens_until_stop
from rlfleet.rollout.engines.hf_batch import QueuedRequest, plan_batches
from rlfleet.rollout.engines.vllm import kv_cache_gib
from rlfleet.rollout.types import SamplingParams


def test_plan_batches_groups_by_settings_and_isolates_seeds() -> None:
    loop = asyncio.new_event_loop()
    try:
        make = lambda s: QueuedRequest("r", [1], s, loop.create_future())  # noqa: E731
        a, b = make(SamplingParams(n=2)), make(SamplingParams(n=3))
        c = make(SamplingParams(temperature=0))
        d, e = make(SamplingParams(seed=1)), make(SamplingParams(seed=1))
        big = [make(SamplingParams(n=300, top_k=5)) for _ in range(2)]
        short = make(SamplingParams(n=2, max_tokens=3))  # each row stops at its own budget
        groups = plan_batches([a, c, b, d, e, *big, short])
    finally:
        loop.close()
    assert [a, b, short] in groups and [c] in groups and [d] in groups and [e] in groups
    assert [big[0]] in groups and [big[1]] in groups  # 600 rows > MAX_ROWS_PER_CALL


def test_stop_helpers() -> None:
    assert cut_at_stop("12+34=46", ["=", "+"]) == ("12", True)
    assert cut_at_stop("1234", ["9"]) == ("1234", False)
    decode = lambda ids: "".join(str(i) for i in ids)  # noqa: E731
    assert tokens_until_stop([1, 2, 3, 4], decode, ["23"]) == ([1, 2, 3], True)
    assert tokens_until_stop([1, 2], decode, []) == ([1, 2], False)


def test_check_state_dict_accepts_tied_extras_only_when_optional() -> None:
    expected = {"w": (2, 2)}
    check_state_dict(
        {"w": torch.zeros(2, 2), "tied": torch.zeros(2, 2)}, expected, frozenset({"tied"})
    )
    with pytest.raises(InvalidArgument):
        check_state_dict({"w": torch.zeros(2, 2), "tied": torch.zeros(2, 2)}, expected)


def test_kv_cache_space_is_whole_gib_at_least_one() -> None:
    assert [kv_cache_gib(x) for x in (0.25, 1.0, 1.5, 4)] == ["1", "1", "2", "4"]
