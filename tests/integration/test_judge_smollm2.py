"""SmolLM2-135M-Instruct as the reward service's judge, served by the fleet itself (issue 21,
part 5).

One rollout replica (hf backend, SmolLM2 in bf16) and a router with its OpenAI-compatible HTTP
front; the reward service's ``judge`` scorer asks it through ``/v1/chat/completions`` and
``/v1/completions``, and a verl GenRM-shaped user ``compute_score`` posts to the same router
address. A 135M model is a poor grader: what is checked is the path, not the grades. Every
item is either scored in [0, 1] from an answer the judge really gave, or an item error with
``reward.default_score`` naming the answer it could not parse; never a transport failure,
and at least one item is scored. Then the router is stopped: every item fails fast with
``default_score``. Skipped when SmolLM2 is not built (``make smollm2``).
"""

from __future__ import annotations

import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import requests
from procs import ServiceProcess
from replica_proc import ReplicaProc, start_replica, stop_replica

from rlfleet.common.config import JudgeConfig, RewardConfig
from rlfleet.common.keys import Keys
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.model.local_models import SMOLLM2, is_built, model_dir
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.service import RewardService
from rlfleet.reward.types import ScoreRequest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not is_built(model_dir(SMOLLM2)),
        reason=f"SmolLM2 is not built ({model_dir(SMOLLM2)} missing): run `make smollm2`",
    ),
]
CONTEXT = "rollout.max_model_len=1024"
ITEM_TIMEOUT_S = 60.0
"""Generous: the path is checked, not speed (a loaded CI machine took over 20 s per answer)."""
CHAT_TEMPLATE = (
    "Question: {prompt}\nStudent's answer: {response}\nCorrect answer: {ground_truth}\n"
    "Is the student's answer correct? Give a grade from 0 to 10. Reply as 'Score: N'."
)
COMPLETION_TEMPLATE = (
    "Question: What is 2+2?\nAnswer: 4\nGrade (0-10): 10\n\n"
    "Question: What is 3+5?\nAnswer: 9\nGrade (0-10): 0\n\n"
    "Question: {prompt}\nAnswer: {response}\nGrade (0-10):"
)
ITEMS = [
    ("What is 6+7?", "13", "13"),
    ("What is 9+9?", "18", "18"),
    ("What is 5+4?", "20", "9"),
    ("What is 8+1?", "9", "9"),
]
GENRM = '''
import re
import requests


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's GenRM shape: the judge is asked over HTTP by the user's own code."""
    prompt = (f"Question: {{extra_info['question']}}\\nAnswer: {{solution_str}}\\n"
              "Is the answer correct? Reply yes or no.")
    reply = requests.post("{base_url}/chat/completions", timeout=60, json={{
        "messages": [{{"role": "user", "content": prompt}}], "max_tokens": 4,
        "temperature": 0}})
    reply.raise_for_status()
    text = reply.json()["choices"][0]["message"]["content"]
    return {{"score": 1.0 if re.search("yes", text, re.I) else 0.0, "answered": float(bool(text))}}
'''


@dataclass
class JudgeFleet:
    replica: ReplicaProc
    router: ServiceProcess
    base_url: str
    redis_url: str


@pytest.fixture(scope="module")
def fleet(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JudgeFleet]:
    """The router is started first and left to load while the replica starts (each takes
    20-30 s on this machine, mostly imports); then both are waited for."""
    logs = tmp_path_factory.mktemp("judge_smollm2")
    keys, url = Keys(f"t{uuid.uuid4().hex[:12]}"), redis_server.url
    model, port, http_port = str(model_dir(SMOLLM2)), free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "rlfleet.rollout.router.main",
        "--port",
        str(port),
        f"redis_url={url}",
        f"cluster={keys.cluster}",
        f"model.path={model}",
        f"router.http_port={http_port}",
        CONTEXT,
    ]
    router = ServiceProcess.start(command, logs / "router.log", name="router")
    try:
        replica = start_replica(
            url,
            keys,
            "judge",
            logs / "replica.log",
            f"model.path={model}",
            "model.dtype=bfloat16",
            "rollout.backend=hf",
            CONTEXT,
        )
        try:
            router.wait_for_line("router ready", 90)
            base_url = f"http://127.0.0.1:{http_port}/v1"
            warm_up(base_url)
            yield JudgeFleet(replica, router, base_url, url)
        finally:
            stop_replica(replica, signal.SIGTERM)
    finally:
        router.stop()


def warm_up(base_url: str) -> None:
    """One short answer through each front before the tests time theirs: the replica's first
    generation pays for lazy set-up (allocations, the chat template) once."""
    models = requests.get(f"{base_url}/models", timeout=30)
    models.raise_for_status()
    served = models.json()["data"][0]["id"]
    for path, body in (
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("completions", {"prompt": "Hi"}),
    ):
        reply = requests.post(
            f"{base_url}/{path}", json={"model": served, "max_tokens": 2, **body}, timeout=180
        )
        reply.raise_for_status()


@pytest.fixture
async def redis(fleet: JudgeFleet) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(fleet.redis_url)
    yield client
    await client.aclose()


def requests_for(scorer: str) -> list[ScoreRequest]:
    return [
        ScoreRequest(
            f"{scorer}-{i}", "arith_judged", response, truth, {"question": question}, scorer=scorer
        )
        for i, (question, response, truth) in enumerate(ITEMS)
    ]


async def scored(redis: aioredis.Redis, reward: RewardConfig, scorer: str) -> list:
    registry = build_registry(reward)
    service = RewardService(
        redis,
        Keys(f"t{uuid.uuid4().hex[:12]}"),
        reward,
        registry,
        WorkerSlots(4),
        item_timeout_s=ITEM_TIMEOUT_S,
    )
    await service.start()
    return await service.score_batch(requests_for(scorer))


def assert_judged(results: list, some_scored: bool) -> None:
    """Each item scored in range, or a parse failure of a real answer at default_score."""
    for result in results:
        if result.error:
            assert result.score == -1.0, result
            assert "no score" in result.error or "outside" in result.error, result.error
        else:
            assert 0.0 <= result.score <= 1.0 and result.metrics["judge_attempts"] >= 1
    assert not some_scored or any(not r.error for r in results), results


@pytest.mark.parametrize("api", ["chat", "completions"])
async def test_smollm2_judges_through_the_router(fleet: JudgeFleet, redis, api: str) -> None:
    """Chat: SmolLM2 often answers in words (garbage to the parser, an item error each);
    completions, few-shot, ends the prompt where a grade goes: some item gets one."""
    template = CHAT_TEMPLATE if api == "chat" else COMPLETION_TEMPLATE
    judge = JudgeConfig(
        base_url=fleet.base_url,
        api=api,
        template=template,
        max_tokens=8,
        timeout_s=ITEM_TIMEOUT_S,
        retries=0,
        score_regex=r"(?i)(?:score|grade)?\W{0,4}?(\d+(?:\.\d+)?)",
    )
    results = await scored(redis, RewardConfig(judge=judge, default_score=-1.0), "judge")
    assert_judged(results, some_scored=api == "completions")


async def test_verl_genrm_user_function_asks_the_router(
    fleet: JudgeFleet, redis, tmp_path: Path
) -> None:
    source = tmp_path / "genrm.py"
    source.write_text(GENRM.format(base_url=fleet.base_url))
    reward = RewardConfig(custom={"path": str(source)}, sandbox=False, default_score=-1.0)
    results = await scored(redis, reward, "compute_score")
    assert all(not r.error and r.metrics["answered"] == 1.0 for r in results), results
    assert all(r.score in (0.0, 1.0) for r in results)


async def test_a_stopped_router_costs_default_score_fast(fleet: JudgeFleet, redis) -> None:
    """Last: the router goes away; the judge's items fail within their budget."""
    fleet.router.stop()
    judge = JudgeConfig(base_url=fleet.base_url, timeout_s=2, retries=2, backoff_s=0.1)
    results = await scored(redis, RewardConfig(judge=judge, default_score=-1.0), "judge")
    assert all(r.score == -1.0 and "after 3 attempt(s)" in r.error for r in results), results
