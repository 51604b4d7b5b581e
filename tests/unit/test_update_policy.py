"""``rollout.update_policy`` on the replica's in-flight requests (``InFlight.make_way`` /
``reopen`` around a swap, ``rollout.continuation``), with a scripted engine.

Why a scripted engine here: it decodes one token per event-loop step, each token a function
of its position only and its log-prob a function of the weights (so an interrupted and
continued sample must come out token for token equal to an uninterrupted one, and every
token's log-prob says which weights sampled it). The transformers engine is checked the same
way on the real tiny model in tests/integration/test_update_keep.py.
"""

from __future__ import annotations

import asyncio

from rlfleet.common.config import load_config
from rlfleet.rollout import continuation
from rlfleet.rollout.engines.base import Engine
from rlfleet.rollout.inflight import InFlight
from rlfleet.rollout.types import Completion, SamplingParams

STEP_S = 0.002


class Chars:
    """Token id t decodes to chr(t) (enough for stop strings)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in ids)


class ScriptedEngine(Engine):
    """Token at position p (prompt + generated) is ``97 + p % 26``; log-prob -version."""

    name = "scripted"

    def __init__(self) -> None:
        super().__init__(load_config(overrides=["model.path=/nonexistent"], env={}))
        self.tokenizer = Chars()
        self.weights = 1
        self.calls: list[tuple[int, int]] = []  # (prompt length, max_tokens) per call
        self._live: dict[str, bool] = {}

    async def start(self) -> None:
        return None

    async def generate(self, request_id, prompt_token_ids, sampling) -> list[Completion]:
        self.calls.append((len(prompt_token_ids), sampling.max_tokens))
        self._live[request_id] = False
        try:
            return list(
                await asyncio.gather(
                    *(
                        self._sample(request_id, len(prompt_token_ids), sampling)
                        for _ in range(sampling.n)
                    )
                )
            )
        finally:
            self._live.pop(request_id, None)

    async def _sample(self, request_id: str, start: int, sampling) -> Completion:
        tokens: list[int] = []
        while len(tokens) < sampling.max_tokens:
            if self._live.get(request_id):
                return Completion(tokens, [-float(self.weights)] * len(tokens), "", "abort")
            await asyncio.sleep(STEP_S)
            tokens.append(97 + (start + len(tokens)) % 26)
        return Completion(tokens, [-float(self.weights)] * len(tokens), "", "length")

    async def interrupt(self) -> int:
        for request_id in self._live:
            self._live[request_id] = True
        return len(self._live)

    async def load_weights(self, state_dict) -> None:
        self.weights += 1

    async def flush_cache(self) -> bool:
        return True

    async def abort(self, request_id: str) -> None:
        self._live[request_id] = True

    async def close(self) -> None:
        return None


def expected_tokens(prompt_len: int, count: int) -> list[int]:
    return [97 + (prompt_len + i) % 26 for i in range(count)]


async def run_with_updates(
    policy: str, sampling: SamplingParams, updates: int, every_s: float, drain_s: float = 5.0
) -> tuple[InFlight, ScriptedEngine, asyncio.Task]:
    """One request, and ``updates`` weight swaps every ``every_s`` while it runs
    (``drain_s``: ``rollout.drain_timeout_s``)."""
    engine, inflight = ScriptedEngine(), InFlight("r")
    prompt = list(range(5))
    task = inflight.track(
        lambda key: continuation.generate(
            inflight.gate, engine, key, prompt, sampling, lambda: engine.weights
        )
    )
    for _ in range(updates):
        await asyncio.sleep(every_s)
        await inflight.make_way(engine, policy, drain_s)
        await engine.load_weights({})
        inflight.reopen()
    await asyncio.wait([task], timeout=10)
    return inflight, engine, task


async def test_keep_continues_where_it_was_and_stamps_each_token_with_its_weights() -> None:
    sampling = SamplingParams(n=3, max_tokens=40, temperature=1.0)
    inflight, engine, task = await run_with_updates("keep", sampling, 1, 0.02)
    completions = task.result()
    assert len(completions) == 3
    for c in completions:
        assert c.token_ids == expected_tokens(5, 40)  # nothing lost, nothing sampled twice
        assert c.finish_reason == "length"
        old = c.weight_versions.count(1)
        assert 0 < old < 40 and c.weight_versions == [1] * old + [2] * (40 - old)
        assert c.logprobs == [-float(v) for v in c.weight_versions]  # each from its weights
    stats = inflight.gate.stats
    assert stats.tokens_discarded == 0 and stats.requests_restarted == 0
    assert stats.requests_resumed == 3
    assert stats.tokens_kept == sum(c.weight_versions.count(1) for c in completions)
    # each sample was resubmitted alone: its prompt grew by its tokens, its budget shrank
    assert all(n + m == 5 + 40 for n, m in engine.calls[1:]) and len(engine.calls) == 4


async def test_restart_throws_the_request_away_and_counts_its_tokens() -> None:
    sampling = SamplingParams(n=2, max_tokens=40)
    inflight, _, task = await run_with_updates("restart", sampling, 1, 0.02, drain_s=0.01)
    assert task.cancelled()  # RestartedByUpdate is a CancelledError: the runner re-queues it
    stats = inflight.gate.stats
    assert stats.requests_restarted == 1 and stats.tokens_discarded > 0


async def test_finish_lets_the_request_end_under_the_old_weights() -> None:
    sampling = SamplingParams(n=1, max_tokens=20)
    inflight, engine, task = await run_with_updates("finish", sampling, 1, 0.01)
    [c] = task.result()
    assert c.weight_versions == [1] * 20 and c.token_ids == expected_tokens(5, 20)
    assert engine.weights == 2 and inflight.gate.stats.tokens_discarded == 0


async def test_a_push_storm_under_keep_answers_once_with_every_tokens_version_right() -> None:
    sampling = SamplingParams(n=2, max_tokens=60)
    inflight, engine, task = await run_with_updates("keep", sampling, 6, 0.015)
    completions = task.result()
    for c in completions:
        assert c.token_ids == expected_tokens(5, 60)
        assert c.weight_versions == sorted(c.weight_versions)  # versions only go up
        assert len(set(c.weight_versions)) >= 3  # crossed several updates
        assert c.logprobs == [-float(v) for v in c.weight_versions]
    assert inflight.gate.stats.tokens_discarded == 0
    assert not len(inflight)  # answered, nothing left running


class FullBudgetEngine(ScriptedEngine):
    """Interrupted exactly when the budget is spent: ``abort`` with every token."""

    async def _sample(self, request_id: str, start: int, sampling) -> Completion:
        while not self._live.get(request_id):
            await asyncio.sleep(STEP_S)
        tokens = expected_tokens(start, sampling.max_tokens)
        return Completion(tokens, [-1.0] * len(tokens), "", "abort")


async def test_an_update_arriving_when_the_budget_is_zero_ends_the_sample_as_length() -> None:
    engine, inflight = FullBudgetEngine(), InFlight("r")
    task = inflight.track(
        lambda key: continuation.generate(
            inflight.gate, engine, key, [1, 2], SamplingParams(max_tokens=8), lambda: 1
        )
    )
    await asyncio.sleep(0.01)
    await inflight.make_way(engine, "keep", 5.0)
    inflight.reopen()
    [c] = await task
    assert (c.finish_reason, len(c.token_ids), len(engine.calls)) == ("length", 8, 1)


def test_a_stop_string_straddling_the_update_is_found_in_the_joined_tokens() -> None:
    engine = ScriptedEngine()
    sampling = SamplingParams(max_tokens=10, stop=["cd"])
    done = Completion([97, 98, 99], [-1.0] * 3, "abc", "abort", [1, 1, 1])
    more = Completion([100, 101], [-2.0] * 2, "de", "length", [2, 2])
    joined = continuation.join(done, more, engine, sampling)
    assert (joined.token_ids, joined.text, joined.finish_reason) == (
        [97, 98, 99, 100],
        "ab",
        "stop",
    )
    assert joined.weight_versions == [1, 1, 1, 2] and joined.logprobs == [-1.0] * 3 + [-2.0]


def test_oldest_version_is_the_smallest_tokens() -> None:
    cs = [Completion([1, 2], [], "", "stop", [3, 4]), Completion([5], [], "", "stop", [5])]
    assert continuation.oldest_version(cs, 9) == 3
    assert continuation.oldest_version([Completion([], [], "", "abort")], 9) == 9
