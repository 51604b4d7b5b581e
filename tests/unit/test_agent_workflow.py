"""Agent workflows (``async def run(data, *, base_url, api_key, session_id)``): recognised by
their signature, their return made a reward, and a gateway session's record made the Episode
the trainer trains (its sampled tokens exactly the recorded ones). The end-to-end path, with a
real router and an ``openai``-client agent, is tests/integration/test_agent_gateway.py.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from rlfleet.agent.adapters import FUNCTION_ADAPTERS, is_gateway_env, load_env_factory
from rlfleet.agent.adapters.workflow import (
    GatewaySessions,
    WorkflowEnv,
    WorkflowError,
    episode_of,
    is_workflow,
    reward_of,
)
from rlfleet.common.trajectory import NO_VERSION
from rlfleet.rollout.gateway.trajectory import CallRecord, session_episode


async def run(data, *, base_url, api_key, session_id):
    return 1.0


async def with_options(data, *, base_url, api_key, session_id, tries: int = 2):
    return {"reward": 1.0}


async def positional(data, base_url, api_key, session_id):
    return 1.0


def plain(data, *, base_url, api_key, session_id):
    return 1.0


async def no_session(data, *, base_url, api_key):
    return 1.0


def test_workflows_are_recognised_by_their_signature() -> None:
    assert is_workflow(run) and is_workflow(with_options)
    for other in (positional, plain, no_session, WorkflowEnv, 3):
        assert not is_workflow(other)
    assert FUNCTION_ADAPTERS[0][0] is is_workflow  # before the factory rule: never called bare


def test_agent_env_naming_a_workflow_plays_through_the_gateway() -> None:
    made = load_env_factory("examples.agents.openai_agent:run", {"max_turns": 3})()
    assert isinstance(made, WorkflowEnv) and is_gateway_env(made)
    assert made.kwargs == {"max_turns": 3}


def test_reward_from_a_number_a_dict_or_the_session() -> None:
    assert reward_of(1, None) == (1.0, {})
    assert reward_of({"reward": 0.5, "format": 1, "length": 0.25}, None) == (
        0.5,
        {"format": 1.0, "length": 0.25},
    )
    assert reward_of({"reward": 1.0, "reward_parts": {"a": 2}}, None) == (1.0, {"a": 2.0})
    assert reward_of(None, 0.75) == (0.75, {})


@pytest.mark.parametrize(
    ("outcome", "recorded", "says"),
    [
        (None, None, "set no reward"),
        (math.nan, None, "finite"),
        (True, None, "finite"),
        ("1.0", None, "finite"),
        ({"score": 1.0}, None, "'reward'"),
        ({"reward": 1.0, "note": "text"}, None, "note"),
        ({"reward": 1, "reward_parts": [1]}, None, "reward_parts"),
    ],
)
def test_a_return_that_is_no_reward_is_a_clear_error(outcome, recorded, says) -> None:
    with pytest.raises(WorkflowError, match=says):
        reward_of(outcome, recorded)


def call(prompt: list[int], sampled: list[int], version: int = 3) -> CallRecord:
    return CallRecord(
        prompt,
        sampled,
        [-0.5] * len(sampled),
        [version] * len(sampled),
        tool_calls=1,
        message={"role": "assistant", "content": "x"},
    )


def test_a_token_native_session_is_one_episode_of_exactly_the_sampled_tokens() -> None:
    first = call([1, 2, 3], [7, 8, 2])
    second = call([1, 2, 3, 7, 8, 2, 9, 9], [5, 2], version=4)  # the tool reply 9 9 between
    record = session_episode("rls-x", [first, second], None)
    episode = episode_of("ep-1", record, {"reward": 1.0, "right": 1.0})
    assert record["token_native"] and episode.prompt_ids == [1, 2, 3]
    assert episode.response_ids == [7, 8, 2, 9, 9, 5, 2]
    assert episode.response_mask == [1, 1, 1, 0, 0, 1, 1]
    assert episode.sampled_ids() == first.token_ids + second.token_ids
    assert episode.response_versions == [3, 3, 3, NO_VERSION, NO_VERSION, 4, 4]
    assert (episode.num_turns, episode.tool_calls, episode.reward) == (2, 2, 1.0)
    assert episode.reward_parts == {"right": 1.0} and len(episode.messages) == 2
    assert episode.oldest_version == 3


def test_a_rewritten_history_trains_every_call_as_branches() -> None:
    calls = [call([1, 2], [7, 2]), call([1, 2, 9, 9], [5, 2]), call([1, 2, 9, 9, 5, 2, 4], [6])]
    record = session_episode("rls-x", calls, 0.5)
    assert not record["token_native"] and record["num_branches"] == 2
    episode = episode_of("ep-2", record, None)  # the reward set through /rl/set_reward
    assert episode.prompt_ids == [1, 2, 9, 9] and episode.sampled_ids() == [5, 2, 6]
    [earlier] = episode.earlier
    assert earlier.prompt_ids == [1, 2] and earlier.sampled_ids() == [7, 2]
    trained = [t for branch in episode.branches() for t in branch.sampled_ids()]
    assert trained == [t for c in calls for t in c.token_ids]  # no sampled token dropped
    assert episode.reward == 0.5 and episode.num_turns == 3 and episode.sampled_tokens == 5


def test_every_call_mode_keeps_each_call_a_record_of_its_own() -> None:
    calls = [call([1, 2], [7, 2]), call([1, 2, 7, 2, 9], [5])]  # token-native, kept apart
    record = session_episode("rls-x", calls, 1.0, mode="every_call")
    assert record["token_native"] and record["num_branches"] == 2
    episode = episode_of("ep-4", record, None)
    assert [b.prompt_ids for b in episode.branches()] == [[1, 2], [1, 2, 7, 2, 9]]
    assert [b.response_mask for b in episode.branches()] == [[1, 1], [1]]
    assert episode.decode(episode.encode()) == episode  # the branches travel in its bytes


def test_a_session_record_that_is_no_trajectory_is_refused() -> None:
    record = session_episode("rls-x", [call([1], [2])], 1.0)
    record["branches"][0]["response_mask"] = [2]
    with pytest.raises(WorkflowError, match="response_mask"):
        episode_of("ep-5", record, None)


def test_a_session_without_calls_is_no_episode() -> None:
    with pytest.raises(WorkflowError, match="no generation call"):
        episode_of("ep-3", session_episode("rls-x", [], None), 1.0)


def test_the_session_routes_sit_beside_the_openai_base() -> None:
    sessions = GatewaySessions("http://127.0.0.1:9/v1/", "key")
    assert str(sessions._http.base_url).rstrip("/") == "http://127.0.0.1:9"
    assert sessions._http.headers["Authorization"] == "Bearer key"


class FlakyGateway:
    """An httpx transport that fails the first ``failures`` calls of each path with ``error``."""

    def __init__(self, error: type[Exception], failures: int) -> None:
        self.error, self.failures, self.calls = error, failures, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request.url.path)
        if self.calls.count(request.url.path) <= self.failures:
            raise self.error("dropped", request=request)
        if request.url.path == "/rl/start_session":
            return httpx.Response(200, json={"session_id": "rls-" + "0" * 32})
        return httpx.Response(200, json={"session_id": json.loads(request.content)["session_id"]})


def sessions_over(gateway: FlakyGateway) -> GatewaySessions:
    return GatewaySessions("http://gw/v1", None, transport=httpx.MockTransport(gateway))


async def test_end_is_asked_again_when_its_answer_is_lost(monkeypatch) -> None:
    monkeypatch.setattr("rlfleet.agent.adapters.workflow.RETRY_BASE_S", 0.0)
    gateway = FlakyGateway(httpx.ReadError, failures=2)
    answer = await sessions_over(gateway).end("rls-" + "1" * 32, "every_call")
    assert answer["session_id"] == "rls-" + "1" * 32 and gateway.calls.count("/rl/end_session") == 3


async def test_start_is_tried_again_only_when_the_request_never_left(monkeypatch) -> None:
    monkeypatch.setattr("rlfleet.agent.adapters.workflow.RETRY_BASE_S", 0.0)
    assert await sessions_over(FlakyGateway(httpx.ConnectError, failures=1)).start()
    read_lost = FlakyGateway(httpx.ReadError, failures=1)  # may have started a session
    with pytest.raises(httpx.ReadError):
        await sessions_over(read_lost).start()
    assert read_lost.calls == ["/rl/start_session"]
