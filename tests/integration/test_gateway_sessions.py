"""The agent gateway's sessions on a real Redis (``SessionStore``) and the pure mapping around
them (``trajectory``, ``gateway_api``): what a call records, how a session ends, and every
refusal naming its field. The HTTP routes are driven in tests/integration/test_agent_gateway.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rlfleet.common.keys import Keys
from rlfleet.rollout.gateway import extensions as gw
from rlfleet.rollout.gateway.openai_api import ChatBody
from rlfleet.rollout.gateway.sessions import (
    BadSessionField,
    EndedSession,
    SessionStore,
    UnknownSession,
    check_reward,
    is_session_id,
)
from rlfleet.rollout.gateway.trajectory import CallRecord, branches_of
from rlfleet.rollout.types import Completion, GenerateResult
from rlfleet.rollout.types import InvalidField as BadField


def record(prompt: list[int], sampled: list[int]) -> CallRecord:
    return CallRecord(prompt, sampled, [-1.0] * len(sampled), [0] * len(sampled))


@pytest.fixture
def store(redis_client, cluster_name: str) -> SessionStore:
    return SessionStore(redis_client, Keys(cluster_name), ttl_s=30.0, max_calls=3)


async def test_a_session_records_its_calls_in_order_and_ends_once(store: SessionStore) -> None:
    session = await store.start()
    assert is_session_id(session) and not is_session_id("conv-1")
    await store.check_open(session, "user")
    assert await store.record(session, [record([1, 2], [3, 4])], "user") == 1
    assert await store.record(session, [record([1, 2, 3, 4, 5], [6])], "user") == 2
    await store.set_reward(session, 0.25)
    episode = await store.end(session)
    assert episode["num_calls"] == 2 and episode["token_native"] and episode["reward"] == 0.25
    [branch] = episode["branches"]
    assert branch["response_ids"] == [3, 4, 5, 6] and branch["response_mask"] == [1, 1, 0, 1]
    assert await store.end(session) == episode  # idempotent: a lost answer may be asked again
    with pytest.raises(EndedSession) as ended:
        await store.record(session, [record([1], [2])], "X-Session-ID")
    assert ended.value.param == "X-Session-ID"
    stats = await store.stats()
    assert (stats["started"], stats["ended"], stats["calls"], stats["open"]) == (1, 1, 2, 0)


async def test_unknown_malformed_and_full_sessions_are_refused(store: SessionStore) -> None:
    with pytest.raises(UnknownSession, match="never started here"):
        await store.end("rls-" + "a" * 32)
    with pytest.raises(BadSessionField) as bad:
        await store.set_reward("rls-short", 1.0)
    assert bad.value.param == "session_id"
    with pytest.raises(BadSessionField):
        check_reward(float("nan"))
    session = await store.start()
    await store.record(session, [record([1], [2])] * 3, "user")
    with pytest.raises(EndedSession, match="3 calls"):
        await store.record(session, [record([1], [2])], "user")
    assert (await store.end(session, reward=1.0))["reward"] == 1.0


async def test_a_session_that_never_ends_expires_and_is_counted(redis_client, cluster_name):
    store = SessionStore(redis_client, Keys(cluster_name), ttl_s=0.2)
    session = await store.start()
    await store.record(session, [record([1], [2])], "user")
    deadline = time.monotonic() + 10
    while (await store.stats())["expired"] != 1:  # swept once past its 0.2 s deadline
        assert time.monotonic() < deadline, "the session was never counted expired"
        await asyncio.sleep(0.05)
    with pytest.raises(UnknownSession):
        await store.check_open(session, "user")


async def test_a_rewritten_history_is_counted_segmented(store: SessionStore) -> None:
    session = await store.start()
    await store.record(session, [record([1, 2], [3]), record([1, 9], [4])], "user")
    episode = await store.end(session)
    assert not episode["token_native"] and episode["num_branches"] == 2
    assert await store.end(session) == episode
    assert (await store.stats())["segmented"] == 1  # counted once


async def test_a_second_end_after_the_answer_is_gone_is_refused(
    store, redis_client, monkeypatch
) -> None:
    monkeypatch.setattr("rlfleet.rollout.gateway.sessions.ENDED_ANSWER_S", 0.05)
    session = await store.start()
    await store.record(session, [record([1], [2])], "user")
    await store.end(session)
    calls, deadline = f"{store._prefix}:session_calls:{session}", time.monotonic() + 10
    while await redis_client.exists(calls):  # the kept answer expires after ENDED_ANSWER_S
        assert time.monotonic() < deadline, "the ended session's answer was never dropped"
        await asyncio.sleep(0.05)
    with pytest.raises(EndedSession) as ended:
        await store.end(session)
    assert ended.value.param == "session_id"


def test_branches_follow_the_prompts() -> None:
    calls = [record([1], [2, 3]), record([1, 2, 3, 7], [8]), record([5], [6])]
    first, second = branches_of(calls)
    assert first.response_ids == [2, 3, 7, 8] and first.response_mask == [1, 1, 0, 1]
    assert second.prompt_ids == [5] and second.response_mask == [1]
    every = branches_of(calls, "every_call")
    assert [b.prompt_ids for b in every] == [[1], [1, 2, 3, 7], [5]]
    assert [t for b in every for t in b.sampled_ids()] == [2, 3, 8, 6]


class Tokenizer:
    """Decodes one character per id (``<tool_call>`` and ``</tool_call>`` are single ids)."""

    chat_template, eos_token_id = "x", 0
    VOCAB = {1: "<tool_call>", 2: "</tool_call>"}

    def decode(self, ids: list[int], **kwargs) -> str:
        return "".join(self.VOCAB.get(i, chr(i)) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def result(token_ids: list[int], text: str = "") -> GenerateResult:
    completion = Completion(token_ids, [-0.1] * len(token_ids), text, "stop")
    return GenerateResult("r", [completion], 2, "rep", [9, 9])


def test_tool_calls_are_parsed_from_the_sampled_ids() -> None:
    sampled = [1, *ids('{"name":"add","arguments":{"a":1,"b":2}}'), 2, 0]
    [choice] = gw.choices_of([result(sampled, "text without tags")], Tokenizer(), tools_on=True)
    assert choice.finish_reason == "tool_calls" and choice.message["content"] is None
    [call] = choice.message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}
    assert call["id"].startswith("call_") and call["id"].endswith("_0")
    recorded = choice.record()
    assert recorded.token_ids == sampled and recorded.versions == [2] * len(sampled)
    assert recorded.tool_calls == 1 and recorded.finish_reason == "tool_calls"


def test_a_broken_call_keeps_the_text_and_no_tools_keeps_the_engine_text() -> None:
    [broken] = gw.choices_of([result([*ids("hi"), 1, *ids("{oops"), 2])], Tokenizer(), True)
    assert broken.message["content"] == "hi<tool_call>{oops</tool_call>"
    assert broken.tool_errors == 1 and "tool_calls" not in broken.message
    [plain] = gw.choices_of([result(ids("12"), "12")], Tokenizer(), tools_on=False)
    assert plain.message == {"role": "assistant", "content": "12"} and plain.tool_calls == 0


def test_token_ids_are_asked_in_the_body_or_in_extra_body() -> None:
    messages = [{"role": "user", "content": "1"}]
    assert gw.wants_token_ids(ChatBody(messages=messages, return_token_ids=True))
    assert gw.wants_token_ids(ChatBody(messages=messages, extra_body={"return_token_ids": True}))
    assert not gw.wants_token_ids(ChatBody(messages=messages))
    fields = gw.response_token_fields([result([5, 0])])
    assert fields == {"prompt_token_ids": [9, 9], "weight_version": 2}


def test_tools_must_be_functions_and_tool_choice_none_turns_them_off() -> None:
    tool = {"type": "function", "function": {"name": "add", "parameters": {}}}
    messages = [{"role": "user", "content": "1"}]
    assert gw.tools_of(ChatBody(messages=messages, tools=[tool])) == [tool]
    assert gw.tools_of(ChatBody(messages=messages, tools=[tool], tool_choice="none")) is None
    with pytest.raises(BadField) as bad:
        gw.tools_of(ChatBody(messages=messages, tools=[{"type": "function"}]))
    assert bad.value.field == "tools[0]"
