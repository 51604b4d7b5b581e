"""The router's OpenAI front as an agent gateway, driven by real clients: the ``openai`` client
with ``tools`` and ``return_token_ids``, AReaL-shaped sessions (``/rl/*``), an agent workflow
(``examples/agents/openai_agent.py``) and verifiers environments
(``examples/agents/verifiers_calc.py``) played by the env worker's ``EpisodeRunner``.

Real Redis, one hf replica of ``models/tiny-qwen2-agent`` and two routers on one cluster: ``A``
open, ``B`` behind an API key with 4 s sessions. Checked: tool calls come back parsed, token
ids, log-probs and versions come back and are recorded, the episode's trained tokens are
exactly the sampled ones, sessions span routers, bad ids are 4xx naming the field, a session
that never ends expires and is counted, and a workflow that raises or hangs is a counted
failed episode whose session is ended. One fleet per file; each process stopped by its PID.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from procs import ROOT
from replica_proc import ReplicaProc, start_replica, stop_replica
from router_proc import RouterProc, start_http_router

from rlfleet.agent.adapters import load_env_factory
from rlfleet.common.config.agent import AgentConfig
from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.env.runner import EpisodeRunner, load_renderer
from rlfleet.env.types import EpisodeJob, EpisodeSettings, QueuedEpisode
from rlfleet.model.model_io import load_tokenizer
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import SamplingParams

AGENT_MODEL = ROOT / "models" / "tiny-qwen2-agent"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (AGENT_MODEL / "model.safetensors").exists(), reason="tiny agent model not built"
    ),
]
KEY = "gateway-test-key"
LENGTH = "rollout.max_model_len=512"  # the agent model's context
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        },
    },
}
TASK = {
    "prompt": [{"role": "user", "content": "12+34+56="}],
    "reward_model": {"ground_truth": "102"},
    "extra_info": {"numbers": [12, 34, 56]},
}
ANSWERS = ["call the tool", "46", "102"]


@dataclass
class Fleet:
    keys: Keys
    replica: ReplicaProc
    a: RouterProc
    b: RouterProc


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("agent_gateway")
    keys, url = Keys(f"t{uuid.uuid4().hex[:12]}"), redis_server.url
    replica = start_replica(
        url, keys, "ga", logs / "ga.log", "rollout.backend=hf", LENGTH, f"model.path={AGENT_MODEL}"
    )
    routers: list[RouterProc] = []
    try:
        routers.append(start_http_router(url, keys, logs / "a.log", LENGTH, model=AGENT_MODEL))
        routers.append(
            start_http_router(
                url,
                keys,
                logs / "b.log",
                LENGTH,
                f"api_key={KEY}",
                "agent.gateway_session_ttl_s=4",
                model=AGENT_MODEL,
            )
        )
        yield Fleet(keys, replica, *routers)
    finally:
        for router in routers:
            router.proc.stop()
        stop_replica(replica)


def rl(router: RouterProc, path: str, body: dict | None = None, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if body is None:
        return httpx.get(f"{router.http}/rl/{path}", headers=headers, timeout=30)
    return httpx.post(f"{router.http}/rl/{path}", json=body, headers=headers, timeout=30)


def chat(router: RouterProc, session: str, messages: list, key: str = "unused", **extra):
    client = openai.OpenAI(
        base_url=router.base_url,
        api_key=key,
        max_retries=0,
        default_headers={"X-Session-ID": session} if session else {},
    )
    return client.chat.completions.create(
        model="any-name",
        messages=messages,
        tools=[ADD],
        max_tokens=40,
        extra_body={"return_token_ids": True},
        **extra,
    )


def test_tools_come_back_as_tool_calls_with_token_ids(fleet: Fleet) -> None:
    client = openai.OpenAI(base_url=fleet.a.base_url, api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=name,
        messages=TASK["prompt"],
        tools=[ADD],
        max_tokens=40,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    tokenizer = load_tokenizer(str(AGENT_MODEL))
    rendered = tokenizer.apply_chat_template(
        TASK["prompt"], tools=[ADD], tokenize=False, add_generation_prompt=True
    )
    extra = answer.model_extra
    assert extra["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert extra["weight_version"] == 0
    choice = answer.choices[0]
    ids, logprobs = choice.model_extra["token_ids"], choice.logprobs.content
    assert ids and len(logprobs) == len(ids) and all(lp.logprob <= 0 for lp in logprobs)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if "<tool_call>" in text and choice.message.tool_calls:  # the warm-started policy calls add
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "add" and json.loads(call.function.arguments)
    plain = client.chat.completions.create(model=name, messages=TASK["prompt"], max_tokens=4)
    assert "prompt_token_ids" not in (plain.model_extra or {})


def play_calc(router: RouterProc, session: str, key: str = "unused") -> list:
    """The calc conversation through ``router``: each tool call answered; the answers seen."""
    messages, seen = list(TASK["prompt"]), []
    for _ in range(4):
        answer = chat(router, session, messages, key, temperature=1.0)
        seen.append(answer)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": str(int(args.get("a", 0)) + int(args.get("b", 0))),
                }
            )
    return seen


def masked(branches: list[dict], name: str) -> list:
    """The values of ``name`` at the sampled positions (mask 1), branch after branch."""
    return [
        value
        for branch in branches
        for value, mask in zip(branch[name], branch["response_mask"], strict=True)
        if mask
    ]


def test_a_session_records_the_sampled_tokens_across_routers(fleet: Fleet) -> None:
    session = rl(fleet.b, "start_session", {}, KEY).json()["session_id"]
    seen = play_calc(fleet.a, session)  # started through B, sampled through A
    assert rl(fleet.b, "set_reward", {"session_id": session, "reward": 0.5}, KEY).status_code == 200
    episode = rl(fleet.b, "end_session", {"session_id": session}, KEY).json()
    assert episode["num_calls"] == len(seen) and episode["reward"] == 0.5
    segments = episode["branches"]
    choices = [answer.choices[0] for answer in seen]
    assert masked(segments, "response_ids") == [
        t for c in choices for t in c.model_extra["token_ids"]
    ]
    assert masked(segments, "response_logprobs") == pytest.approx(
        [x.logprob for c in choices for x in c.logprobs.content]
    )
    assert set(masked(segments, "response_versions")) == {0}
    assert episode["token_native"] == (len(segments) == 1)
    assert episode["num_branches"] == len(segments) and episode["multi_call"] == "merge_prefixes"
    first = seen[0].model_extra["prompt_token_ids"]
    assert segments[0]["prompt_ids"] == first
    stats = rl(fleet.a, "stats").json()
    assert stats["started"] >= 1 and stats["ended"] >= 1 and stats["calls"] >= len(seen)


def test_bad_and_ended_session_ids_are_4xx_naming_the_field(fleet: Fleet) -> None:
    unknown = "rls-" + "0" * 32
    answer = rl(fleet.a, "end_session", {"session_id": unknown})
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "session_id"
    answer = rl(fleet.a, "set_reward", {"session_id": "nope", "reward": 1.0})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "session_id"
    answer = rl(fleet.a, "end_session", {})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "session_id"
    session = rl(fleet.a, "start_session", {}).json()["session_id"]
    answer = rl(fleet.a, "set_reward", {"session_id": session, "reward": "high"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "reward"
    with pytest.raises(openai.BadRequestError) as refused:
        chat(fleet.a, session, TASK["prompt"], n=2)
    assert refused.value.body["param"] == "n"
    first = rl(fleet.a, "end_session", {"session_id": session}).json()
    assert first["num_calls"] == 0
    assert rl(fleet.a, "end_session", {"session_id": session}).json() == first  # idempotent
    answer = rl(fleet.a, "end_session", {"session_id": session, "multi_call": "all"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "multi_call"
    with pytest.raises(openai.APIStatusError) as refused:
        chat(fleet.a, session, TASK["prompt"])
    assert refused.value.status_code == 409 and refused.value.body["param"] == "X-Session-ID"
    with pytest.raises(openai.NotFoundError) as refused:
        chat(fleet.a, unknown, TASK["prompt"])
    assert refused.value.body["param"] == "X-Session-ID"


def test_session_routes_need_the_key_where_one_is_set(fleet: Fleet) -> None:
    assert rl(fleet.b, "start_session", {}).status_code == 401
    assert rl(fleet.b, "stats").status_code == 401
    assert rl(fleet.b, "start_session", {}, "wrong").status_code == 401


def test_a_session_that_never_ends_expires_and_is_counted(fleet: Fleet) -> None:
    before = rl(fleet.b, "stats", key=KEY).json()["expired"]
    session = rl(fleet.b, "start_session", {}, KEY).json()["session_id"]
    time.sleep(5.0)  # B's sessions live 4 s
    assert rl(fleet.b, "stats", key=KEY).json()["expired"] >= before + 1
    answer = rl(fleet.b, "end_session", {"session_id": session}, KEY)
    assert answer.status_code == 404 and "expired" in answer.json()["error"]["message"]


# ---- the env worker's side: workflows and verifiers environments --------------------------


def runner_for(
    fleet: Fleet,
    env: str,
    env_kwargs: dict | None = None,
    timeout_s: float = 120.0,
    multi_call: str = "merge_prefixes",
) -> EpisodeRunner:
    agent = AgentConfig(
        env=env,
        env_kwargs=env_kwargs or {},
        gateway_url=fleet.a.base_url,
        episode_timeout_s=timeout_s,
        step_timeout_s=min(60.0, timeout_s),
        tool_timeout_s=min(10.0, timeout_s),
        multi_call=multi_call,
    )
    make_env = load_env_factory(agent.env, agent.env_kwargs)
    client = RolloutClient(fleet.a.address)
    return EpisodeRunner(make_env, load_renderer(str(AGENT_MODEL)), client, agent)


async def play(runner: EpisodeRunner, task: dict = TASK, max_tokens: int = 40):
    from rlfleet.agent.episode import Episode

    settings = EpisodeSettings(SamplingParams(temperature=1.0, max_tokens=max_tokens), 4, 400)
    outcome = await runner.play(
        QueuedEpisode(EpisodeJob(f"ep-{uuid.uuid4().hex[:8]}", task), settings)
    )
    await runner.client.close()
    return outcome, Episode.decode(outcome.episode)


async def test_an_openai_agent_workflow_trains_its_sampled_tokens(fleet: Fleet) -> None:
    runner = runner_for(fleet, "examples.agents.openai_agent:run")
    outcome, episode = await play(runner)
    assert not outcome.error and not episode.failed, outcome.error
    assert episode.num_turns >= 1 and episode.reward_parts["finished"] in (0.0, 1.0)
    assert len(episode.sampled_ids()) == episode.num_sampled > 0
    assert episode.oldest_version == 0 and episode.generate_s > 0
    assert len(episode.response_ids) == len(episode.response_mask) == len(episode.response_versions)


FAILING = """
import asyncio

async def raises(data, *, base_url, api_key, session_id):
    raise RuntimeError("the agent broke")

async def hangs(data, *, base_url, api_key, session_id):
    await asyncio.sleep(3600)
"""


async def test_a_workflow_that_raises_or_hangs_is_a_failed_episode_with_its_session_ended(
    fleet: Fleet, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "failing_workflows.py").write_text(FAILING)
    monkeypatch.syspath_prepend(str(tmp_path))
    ended = rl(fleet.a, "stats").json()["ended"]
    outcome, episode = await play(runner_for(fleet, "failing_workflows:raises"))
    assert episode.failed and "the agent broke" in outcome.error
    began = time.monotonic()
    outcome, episode = await play(runner_for(fleet, "failing_workflows:hangs", timeout_s=3.0))
    assert episode.failed and "timed out" in outcome.error and time.monotonic() - began < 30
    assert rl(fleet.a, "stats").json()["ended"] >= ended + 2  # both sessions were ended


@pytest.mark.parametrize("kind", ["tool", "single", "multi"])
async def test_a_verifiers_environment_runs_unchanged_through_the_gateway(
    fleet: Fleet, kind: str
) -> None:
    pytest.importorskip("verifiers")
    runner = runner_for(
        fleet, "examples.agents.verifiers_calc:load_environment", {"kind": kind, "max_turns": 3}
    )
    outcome, episode = await play(runner, {"question": "12+34+56=", "answer": "102"})
    assert not outcome.error, outcome.error
    assert 1 <= episode.num_turns <= (1 if kind == "single" else 3)
    assert episode.reward in (0.0, 1.0) and "exact_answer" in episode.reward_parts
    assert episode.reward == episode.reward_parts["exact_answer"]
    assert episode.num_sampled > 0 and episode.oldest_version == 0


CUT = """
from openai import AsyncOpenAI

SAMPLED = []  # (finish reason, token ids) of every call, in order


async def run(data, *, base_url, api_key, session_id, max_tokens=5, turns=3):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                         default_headers={"X-Session-ID": session_id})
    messages = list(data["prompt"])
    for _ in range(turns):
        answer = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=max_tokens,
            extra_body={"return_token_ids": True})
        choice = answer.choices[0]
        SAMPLED.append((choice.finish_reason, choice.model_extra["token_ids"]))
        messages.append({"role": "assistant", "content": choice.message.content or ""})
        messages.append({"role": "user", "content": "Continue."})
    await client.close()
    return 1.0
"""


@pytest.mark.parametrize("multi_call", ["merge_prefixes", "every_call"])
async def test_every_call_of_an_agent_cut_by_max_tokens_is_trained(
    fleet: Fleet, tmp_path, monkeypatch: pytest.MonkeyPatch, multi_call: str
) -> None:
    """An ``openai``-client agent whose turns are cut by ``max_tokens`` and re-rendered: every
    call's sampled tokens are trained, in order, with the episode's reward."""
    (tmp_path / "cut_agent.py").write_text(CUT)
    monkeypatch.syspath_prepend(str(tmp_path))
    import cut_agent

    cut_agent.SAMPLED.clear()
    outcome, episode = await play(runner_for(fleet, "cut_agent:run", multi_call=multi_call))
    assert not outcome.error, outcome.error
    assert "length" in [reason for reason, _ in cut_agent.SAMPLED]  # turns were cut
    trained = [t for branch in episode.branches() for t in branch.sampled_ids()]
    assert trained == [t for _, ids in cut_agent.SAMPLED for t in ids]  # nothing dropped
    assert episode.num_turns == 3 and episode.reward == 1.0
    if multi_call == "every_call":
        assert len(episode.branches()) == 3
    print(f"{multi_call}: 3 calls trained as {len(episode.branches())} branch(es)")


async def test_a_verifiers_multi_turn_env_cut_by_max_tokens_trains_every_call(
    fleet: Fleet,
) -> None:
    pytest.importorskip("verifiers")
    runner = runner_for(
        fleet, "examples.agents.verifiers_calc:load_environment", {"kind": "multi", "max_turns": 3}
    )
    calls = rl(fleet.a, "stats").json()["calls"]
    outcome, episode = await play(runner, {"question": "12+34+56=", "answer": "102"}, 6)
    assert not outcome.error, outcome.error
    assert episode.num_turns == rl(fleet.a, "stats").json()["calls"] - calls  # every call
    assert len(episode.messages) == episode.num_turns
    assert all(branch.num_sampled for branch in episode.branches())
    assert episode.num_turns <= episode.sampled_tokens <= 6 * episode.num_turns
    print(f"verifiers multi: {episode.num_turns} calls in {len(episode.branches())} branch(es)")


async def test_session_calls_survive_a_full_steps_concurrency(fleet: Fleet) -> None:
    """256 episodes' sessions at once, each idle about as long as a client keeps a connection
    (5 s): every start and end answers (a ReadError here once failed 5.5% of a step)."""
    from rlfleet.agent.adapters.workflow import GatewaySessions

    async def episode() -> dict:
        sessions = GatewaySessions(fleet.a.base_url, None)
        try:
            session = await sessions.start()
            await asyncio.sleep(random.uniform(4.0, 6.0))
            return await sessions.end(session)
        finally:
            await sessions.close()

    ended = await asyncio.gather(*(episode() for _ in range(256)), return_exceptions=True)
    failed = [repr(e) for e in ended if isinstance(e, BaseException)]
    assert not failed, f"{len(failed)} of 256: {failed[:3]}"


def test_an_idle_connection_outlives_a_clients_keep_alive(fleet: Fleet) -> None:
    """The router keeps an idle connection past 5 s (httpx's and openai's reuse window), so a
    client never sends on a connection the server is closing."""
    host, port = fleet.a.http.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() and conn.sock is not None
        first = conn.sock
        time.sleep(5.5)  # uvicorn's default keep-alive (5 s) closed the connection by now
        conn.request("GET", "/healthz")
        assert conn.getresponse().status == 200 and conn.sock is first  # the same connection
    finally:
        conn.close()
