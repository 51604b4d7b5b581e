"""The ``judge`` scorer against a real HTTP server acting as the judge (issue 21, parts 5, 7).

The judge is a small FastAPI app served by uvicorn on a loopback port, speaking the OpenAI
chat and completions shapes; what it answers depends on the response being graded (``good:N``
scores N, ``garbage`` rambles, ``hang`` never answers, ``flaky`` fails twice with 503 first,
``notjson`` answers 200 with HTML). Checked: scores parsed and normalised, the template
filled (braces that are not placeholders kept), garbage and a down or hanging endpoint give an
item error and ``reward.default_score`` within the retry budget with the attempts counted, a
4xx is not retried, the concurrency bound holds, and verl's GenRM shape (a user
``compute_score`` that posts to the judge itself) works through the service.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from rlfleet.common.config import JudgeConfig, RewardConfig
from rlfleet.common.http_server import make_http_server
from rlfleet.common.keys import Keys
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.common.redis_server import free_port
from rlfleet.reward.batch_scorer import BatchScorer
from rlfleet.reward.judge import DEADLINE_SLACK_S, Judge, fill_template
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.service import RewardService, reward_queue
from rlfleet.reward.types import ScoreRequest
from rlfleet.reward.worker import RewardWorker

MARK = re.compile(r"<<(\w+)(?::(\d+))?>>")


@dataclass
class FakeJudge:
    """What the fake judge saw: requests per mode, bodies, and the most in flight at once."""

    base_url: str = ""
    seen: Counter = field(default_factory=Counter)
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0


def judge_app(state: FakeJudge) -> FastAPI:
    app = FastAPI()

    async def answer(request: Request, chat: bool):
        body = await request.json()
        state.bodies.append(body)
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        found = MARK.search(text)
        mode, value = (found.group(1), found.group(2)) if found else ("none", None)
        state.seen[mode] += 1
        state.in_flight += 1
        state.peak = max(state.peak, state.in_flight)
        try:
            return await reply(mode, value, chat, state.seen[mode])
        finally:
            state.in_flight -= 1

    async def reply(mode: str, value: str | None, chat: bool, count: int):
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "slow":
            await asyncio.sleep(0.1)
        if mode == "flaky" and count <= 2:
            return JSONResponse({"error": "overloaded"}, status_code=503)
        if mode == "refused":
            return JSONResponse({"error": "bad request"}, status_code=400)
        if mode == "notjson":
            return PlainTextResponse("<html>proxy error</html>")
        said = {
            "good": f"The answer is right. Score: {value}",
            "flaky": "Score: 10",
            "slow": "Score: 5",
            "garbage": "I like turtles.",
            "high": "Score: 11",
        }.get(mode, "no idea")
        choice = {"message": {"role": "assistant", "content": said}} if chat else {"text": said}
        return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, **choice}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, chat=False)

    return app


@pytest.fixture
async def fake_judge() -> AsyncIterator[FakeJudge]:
    state, port = FakeJudge(), free_port()
    server = make_http_server(judge_app(state), "127.0.0.1", port)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the fake judge did not start"
        await asyncio.sleep(0.01)
    state.base_url = f"http://127.0.0.1:{port}/v1"
    try:
        yield state
    finally:
        server.should_exit = True
        server.force_exit = True  # a "hang" request is still open
        await asyncio.wait_for(task, 10)


def judge_config(base_url: str, **overrides) -> JudgeConfig:
    fields = {
        "base_url": base_url,
        "timeout_s": 2.0,
        "retries": 2,
        "backoff_s": 0.05,
        "template": "Grade {response} against {ground_truth}. Use \\boxed{} if you like.",
    }
    return JudgeConfig(**{**fields, **overrides})


def item(i: int, response: str, truth: str = "4") -> ScoreRequest:
    return ScoreRequest(str(i), "judged", response, truth, scorer="judge")


async def test_good_answers_are_parsed_and_normalised(fake_judge: FakeJudge) -> None:
    judge = Judge(judge_config(fake_judge.base_url))
    results = await judge.score_items(
        [item(0, "<<good:7>>"), item(1, "<<good:10>>"), item(2, "<<good:0>>")]
    )
    assert [r.error for r in results] == ["", "", ""]
    assert [r.score for r in results] == pytest.approx([0.7, 1.0, 0.0])
    assert results[0].metrics == {"judge_attempts": 1.0, "judge_raw_score": 7.0}
    sent = fake_judge.bodies[0]["messages"][0]["content"]
    assert sent == "Grade <<good:7>> against 4. Use \\boxed{} if you like."
    assert fake_judge.bodies[0]["temperature"] == 0.0 and "model" not in fake_judge.bodies[0]
    await judge.aclose()


async def test_completions_api_system_model_and_raw_scores(fake_judge: FakeJudge) -> None:
    config = judge_config(
        fake_judge.base_url, api="completions", model="judge-model", normalize=False, max_tokens=8
    )
    judge = Judge(config)
    (result,) = await judge.score_items([item(0, "<<good:3>>")])
    assert result.score == 3.0 and not result.error
    body = fake_judge.bodies[0]
    assert body["model"] == "judge-model" and body["max_tokens"] == 8 and "prompt" in body
    await judge.aclose()


async def test_garbage_is_retried_then_an_item_error(fake_judge: FakeJudge) -> None:
    judge = Judge(judge_config(fake_judge.base_url, retries=2))
    garbage, high, html, good = await judge.score_items(
        [item(0, "<<garbage>>"), item(1, "<<high>>"), item(2, "<<notjson>>"), item(3, "<<good:5>>")]
    )
    assert "after 3 attempt(s)" in garbage.error and "no score" in garbage.error
    assert "outside [0, 10]" in high.error and "not JSON" in html.error
    assert garbage.metrics["judge_attempts"] == 3.0
    assert good.score == 0.5 and not good.error  # one bad item fails only itself
    assert fake_judge.seen["garbage"] == 3 and judge.retried == 6 and judge.failed == 3
    await judge.aclose()


async def test_transient_failures_are_retried_and_4xx_is_not(fake_judge: FakeJudge) -> None:
    judge = Judge(judge_config(fake_judge.base_url, retries=2))
    flaky, refused = await judge.score_items([item(0, "<<flaky>>"), item(1, "<<refused>>")])
    assert flaky.score == 1.0 and flaky.metrics["judge_attempts"] == 3.0
    assert "HTTP 400" in refused.error and "after 1 attempt(s)" in refused.error
    assert fake_judge.seen["refused"] == 1
    await judge.aclose()


async def test_a_down_endpoint_fails_fast_within_the_budget() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    judge = Judge(judge_config(f"http://127.0.0.1:{port}/v1", retries=2, backoff_s=0.05))
    started = time.perf_counter()
    results = await judge.score_items([item(i, "<<good:5>>") for i in range(4)])
    took = time.perf_counter() - started
    assert all("after 3 attempt(s)" in r.error and "Connect" in r.error for r in results)
    assert took < judge.item_budget_s(), took
    assert judge.attempts == 12
    await judge.aclose()


async def test_a_hanging_endpoint_costs_at_most_the_budget(fake_judge: FakeJudge) -> None:
    judge = Judge(judge_config(fake_judge.base_url, timeout_s=0.3, retries=1, backoff_s=0.05))
    started = time.perf_counter()
    hung, good = await judge.score_items([item(0, "<<hang>>"), item(1, "<<good:8>>")])
    took = time.perf_counter() - started
    assert "no answer within 0.3s" in hung.error and "after 2 attempt(s)" in hung.error
    assert good.score == pytest.approx(0.8)
    assert 0.6 <= took < judge.item_budget_s() + 0.5, took
    await judge.aclose()


async def test_concurrency_is_bounded(fake_judge: FakeJudge) -> None:
    judge = Judge(judge_config(fake_judge.base_url, max_concurrency=3))
    results = await judge.score_items([item(i, "<<slow>>") for i in range(12)])
    assert all(r.score == 0.5 for r in results)
    assert fake_judge.peak == 3, fake_judge.peak
    await judge.aclose()


async def test_waiting_for_a_slot_does_not_count_against_the_budget(
    fake_judge: FakeJudge,
) -> None:
    """One slot, 25 answers of 0.1 s: the last waits 2.4 s, past one item's budget (0.6 s +
    1 s of slack), and is still scored: the deadline starts when the item gets its slot. (Each
    answer's own 0.6 s leaves a loaded machine room: at 0.25 s, the first exchange, which also
    opens the connection, once ran out of it in CI.)"""
    judge = Judge(judge_config(fake_judge.base_url, max_concurrency=1, timeout_s=0.6, retries=0))
    count = 25
    assert (count - 1) * 0.1 > judge.item_budget_s() + DEADLINE_SLACK_S
    results = await judge.score_items([item(i, "<<slow>>") for i in range(count)])
    assert [r.error for r in results] == [""] * count
    await judge.aclose()


def test_template_placeholders() -> None:
    request = ScoreRequest("1", "src", "resp", ["a", "b"], {"question": "Q?", "level": 3})
    text = fill_template(
        "{prompt}|{response}|{ground_truth}|{data_source}|{extra_info.level}|{other}|\\frac{1}{2}",
        request,
    )
    assert text == 'Q?|resp|["a", "b"]|src|3|{other}|\\frac{1}{2}'
    request.prompt = "the prompt"
    assert fill_template("{prompt}", request) == "the prompt"
    with pytest.raises(Exception, match="extra_info\\['missing'\\]"):
        fill_template("{extra_info.missing}", request)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def service_for(redis: aioredis.Redis, cluster: str, reward: RewardConfig) -> RewardService:
    service = RewardService(redis, Keys(cluster), reward, build_registry(reward), WorkerSlots(4))
    await service.start()
    return service


async def test_through_the_service_failures_get_default_score(
    fake_judge: FakeJudge, redis: aioredis.Redis, cluster_name: str
) -> None:
    """Selected by name and by a claimed data source; garbage and a template the item cannot
    fill become item errors with ``reward.default_score``; built-ins are unaffected."""
    config = judge_config(
        fake_judge.base_url,
        data_sources=["graded"],
        retries=1,
        template="{extra_info.question}: {response}",
    )
    reward = RewardConfig(judge=config, default_score=-1.0)
    service = await service_for(redis, cluster_name, reward)
    requests = [
        ScoreRequest("a", "graded", "<<good:9>>", "", {"question": "2+2"}),
        ScoreRequest("b", "", "<<garbage>>", "", {"question": "2+2"}, scorer="judge"),
        ScoreRequest("c", "graded", "<<good:9>>", "", {}),
        ScoreRequest("d", "arith", "4", "4"),
    ]
    a, b, c, d = await service.score_batch(requests)
    assert a.score == pytest.approx(0.9) and not a.error
    assert b.score == -1.0 and "after 2 attempt(s)" in b.error
    assert c.score == -1.0 and "extra_info['question']" in c.error
    assert d.score == 1.0 and not d.error
    names = {s.name: s.kind for s in service.list_scorers()}
    assert names["judge"] == "model"


GENRM = '''
import re
import requests

JUDGE = "{base_url}"


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's GenRM shape: ask the judge over HTTP, parse its score."""
    prompt = f"Grade {{solution_str}} against {{ground_truth}}."
    reply = requests.post(JUDGE + "/chat/completions", timeout=5, json={{
        "messages": [{{"role": "user", "content": prompt}}], "max_tokens": 16}})
    text = reply.json()["choices"][0]["message"]["content"]
    found = re.findall(r"Score: (\\d+)", text)
    return float(found[-1]) / 10 if found else 0.0
'''


async def test_verl_genrm_user_function_calls_the_judge(
    fake_judge: FakeJudge, redis: aioredis.Redis, cluster_name: str, tmp_path: Path
) -> None:
    """A verl GenRM ``compute_score`` (sync, ``requests``) runs unchanged with
    ``reward.sandbox: false``: the sandbox has no network, threads have."""
    source = tmp_path / "genrm.py"
    source.write_text(GENRM.format(base_url=fake_judge.base_url))
    reward = RewardConfig(custom={"path": str(source)}, sandbox=False)
    service = await service_for(redis, cluster_name, reward)
    # requests blocks its thread; the fake judge lives on this loop, which stays free
    (result,) = await service.score_batch([ScoreRequest("1", "anything", "<<good:6>>", "4")])
    assert result.score == pytest.approx(0.6) and not result.error


async def test_batch_scorer_awaits_the_judge_on_its_own_clock(fake_judge: FakeJudge) -> None:
    """The judge times itself: the service's item timeout (here 0.2 s, less than one slow
    answer takes with the queue of 12) does not cut its items."""
    reward = RewardConfig(judge=judge_config(fake_judge.base_url, max_concurrency=2))
    engine = BatchScorer(build_registry(reward), item_timeout_s=0.2)
    results = await engine.score_all([item(i, "<<slow>>") for i in range(12)])
    assert [r.score for r in results] == [0.5] * 12


async def test_a_worker_on_the_stream_is_never_stuck_on_a_hanging_judge(
    fake_judge: FakeJudge, redis: aioredis.Redis, cluster_name: str
) -> None:
    """Queued path (``local_first: false``): a worker's job of hanging items is answered with
    errors at ``default_score`` within the judge's budget, and the worker takes the next job."""
    config = judge_config(fake_judge.base_url, timeout_s=0.3, retries=1, backoff_s=0.05)
    reward = RewardConfig(judge=config, local_first=False, default_score=-1.0)
    registry, keys = build_registry(reward), Keys(cluster_name)
    service = RewardService(redis, keys, reward, registry)
    await service.start()
    worker = RewardWorker(reward_queue(redis, keys), registry, "w0", item_timeout_s=0.1)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        started = time.perf_counter()
        hung = await service.score_batch([item(i, "<<hang>>") for i in range(3)])
        took = time.perf_counter() - started
        assert all(r.score == -1.0 and "no answer within 0.3s" in r.error for r in hung)
        assert took < Judge(config).item_budget_s() + 2, took
        (good,) = await service.score_batch([item(9, "<<good:4>>")])
        assert good.score == pytest.approx(0.4) and not good.error
        assert worker.scored == 4
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
