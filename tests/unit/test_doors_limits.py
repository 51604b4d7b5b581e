"""Bounded doors without servers: prompt limits, the weight magnitude guard, the recorded
replica config, and tokenization off the event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import InvalidArgument
from rlfleet.rollout import tokenize
from rlfleet.rollout.limits import PromptLimits
from rlfleet.rollout.main import parse
from rlfleet.rollout.types import GenerateRequest, InvalidField, SamplingParams
from rlfleet.rollout.weight_guard import check_magnitude

LIMITS = PromptLimits.of(load_config(env={}).rollout)  # 1 MiB, max_model_len 64


def request(text=None, ids=None, max_tokens=4):
    return GenerateRequest("r1", SamplingParams(max_tokens=max_tokens), ids, text)


def test_a_3mb_prompt_text_is_refused_naming_the_limit():
    with pytest.raises(InvalidField) as refused:
        LIMITS.check(request(text="x" * 3 * 1024 * 1024))
    assert refused.value.field == "prompt_text"
    assert "3145728 bytes > rollout.max_prompt_bytes 1048576 (request 'r1')" in str(refused.value)
    LIMITS.check(request(text="x" * 1024 * 1024))  # exactly at the limit: taken


def test_multibyte_text_is_counted_in_bytes():
    LIMITS.check(request(text="é" * 300_000))  # 600 kB
    with pytest.raises(InvalidField, match="1200000 bytes"):
        LIMITS.check(request(text="é" * 600_000))


def test_token_prompts_are_bounded_by_prompt_tokens_and_model_length():
    with pytest.raises(InvalidField, match="100 tokens > rollout.max_prompt_tokens 63"):
        LIMITS.check(request(ids=[1] * 100))
    with pytest.raises(InvalidField, match="sampling.max_tokens 8 > rollout.max_model_len 64"):
        LIMITS.check(request(ids=[1] * 60, max_tokens=8))
    own = PromptLimits.of(load_config(overrides=["rollout.max_prompt_tokens=10"], env={}).rollout)
    with pytest.raises(InvalidField, match="rollout.max_prompt_tokens 10"):
        own.check(request(ids=[1] * 11))


def test_chat_messages_count_together():
    LIMITS.check_messages(["a" * 500_000, "b" * 500_000])
    with pytest.raises(InvalidField, match="messages hold 1200000 bytes"):
        LIMITS.check_messages(["a" * 600_000, "b" * 600_000])


class SlowEngine:
    """Tokenizes until the event loop has ticked (``loop_ran``: set by the test's ticker, which
    could never tick were the tokenizer blocking the loop) and records the thread it ran on."""

    def __init__(self) -> None:
        self.thread = None
        self.loop_ran = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.thread = threading.current_thread()
        self.loop_ran.wait(30)
        return [1] * len(text)


async def test_tokenization_runs_off_the_event_loop_and_after_the_byte_check():
    engine = SlowEngine()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
            if ticks == 5:
                engine.loop_ran.set()

    task = asyncio.create_task(ticker())
    assert await tokenize.encode(engine, "abc", LIMITS) == [1, 1, 1]
    task.cancel()
    assert engine.thread is not threading.main_thread()
    assert engine.loop_ran.is_set()  # the loop went on while the text was tokenized
    engine.thread = None
    with pytest.raises(InvalidField, match="rollout.max_prompt_bytes"):
        await tokenize.encode(engine, "x" * 2_000_000, LIMITS)
    assert engine.thread is None  # refused before the tokenizer was asked
    with pytest.raises(InvalidField, match="prompt_text has 100 tokens"):
        await tokenize.encode(engine, "x" * 100, LIMITS)


def test_weight_update_scaled_by_1e30_is_refused():
    sane = {"w": torch.randn(64) * 3, "ids": torch.arange(4)}
    check_magnitude(sane, 1e5)
    absurd = {"w": torch.randn(64) * 1e30}
    with pytest.raises(InvalidArgument, match=r"'w'.*> rollout.max_weight_abs 100000"):
        check_magnitude(absurd, 1e5)
    with pytest.raises(InvalidArgument):
        check_magnitude({"w": torch.full((8,), -1e30, dtype=torch.bfloat16)}, 1e5)
    check_magnitude(absurd, None)  # no bound asked for


def test_replica_id_is_in_the_config_before_it_is_recorded(tmp_path: Path):
    for rid in ("ra", "rb"):
        parse(
            [
                "--replica-id",
                rid,
                "--port",
                "0",
                "redis_url=redis://127.0.0.1:1",
                f"run_dir={tmp_path}",
            ]
        )
    assert sorted(p.name for p in tmp_path.glob("config.*.yaml")) == [
        "config.ra.yaml",
        "config.rb.yaml",
    ]
    assert "replica_id: rb" in (tmp_path / "config.rb.yaml").read_text()
