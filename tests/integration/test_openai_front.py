"""The router's OpenAI-compatible HTTP API, driven by real outside clients (the ``openai``
package, raw HTTP, lm-evaluation-harness), and the one validation behind every door: each bad
value sent to a real router (gRPC and HTTP) and a real replica (gRPC) is refused as
INVALID_ARGUMENT / HTTP 400 naming the field, never a retryable or unknown error.

One replica (hf backend, tiny model) and two routers on one cluster: one with the tiny model's
tokenizer (no chat template), one pointed at a copy of it that has a chat template.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
from procs import ROOT, clean_env
from replica_proc import MODEL, ReplicaProc, start_replica, stop_replica
from router_proc import RouterProc, start_http_router

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.proto import rollout_pb2, rollout_pb2_grpc
from rlfleet.rollout.convert import request_to_proto
from rlfleet.rollout.types import GenerateRequest, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]
NAME = MODEL.name
TASK_DATA = ROOT / "tests" / "data" / "lm_eval" / "arith10.jsonl"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@dataclass
class Fleet:
    keys: Keys
    redis_url: str
    replica: ReplicaProc
    router: RouterProc
    chat_router: RouterProc


def templated_model(directory: Path) -> Path:
    """The tiny model's tokenizer files with a chat template: enough for a router."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(MODEL / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def fleet(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("openai_front")
    keys = Keys(f"t{uuid.uuid4().hex[:12]}")
    url = redis_server.url
    replica = start_replica(url, keys, "oa", logs / "oa.log", "rollout.backend=hf")
    routers: list[RouterProc] = []
    try:
        routers.append(start_http_router(url, keys, logs / "router.log"))
        chat_model = templated_model(tmp_path_factory.mktemp("chat_model"))
        routers.append(start_http_router(url, keys, logs / "chat.log", model=chat_model))
        yield Fleet(keys, url, replica, *routers)
    finally:
        for router in routers:
            router.proc.stop()
        stop_replica(replica)


@pytest.fixture
def client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.router.base_url, api_key="unused", max_retries=0)


def test_models_names_the_policy_and_its_weight_version(client: openai.OpenAI) -> None:
    [card] = client.models.list().data
    assert card.id == NAME and card.weight_version == 0


def test_completion_with_the_openai_client(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model=NAME, prompt="12+34=", max_tokens=4, n=2, temperature=0, logprobs=0, seed=7
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].text == answer.choices[1].text  # greedy
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) >= 1
    assert "".join(logprobs.tokens).startswith(answer.choices[0].text)
    assert answer.usage.prompt_tokens == 7  # <bos> 1 2 + 3 4 =
    assert answer.usage.completion_tokens == 2 * len(logprobs.tokens)
    assert answer.system_fingerprint == "weights-v0"


def test_token_id_and_batched_prompts(client: openai.OpenAI) -> None:
    ids = [1, 5, 6, 14, 7, 8, 15]  # <bos>12+34=
    answer = client.completions.create(
        model=NAME, prompt=[ids, ids[:4] + [15]], max_tokens=3, temperature=0
    )
    assert len(answer.choices) == 2 and answer.usage.prompt_tokens == 12
    texts = client.completions.create(model=NAME, prompt=["1+1=", "2+2=", "3+3="], max_tokens=3)
    assert [c.index for c in texts.choices] == [0, 1, 2]


def test_stream_ends_with_done_and_usage(fleet: Fleet, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=NAME,
        prompt="5+6=",
        max_tokens=3,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert sorted(c.choices[0].index for c in chunks if c.choices) == [0, 1]
    assert chunks[-1].usage.total_tokens > 0
    body = {"model": NAME, "prompt": "5+6=", "max_tokens": 2, "stream": True}
    raw = httpx.post(f"{fleet.router.base_url}/completions", json=body, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_session_from_user_or_header_pins_the_replica(fleet: Fleet, client: openai.OpenAI):
    client.completions.create(model=NAME, prompt="1+2=", max_tokens=2, user="conv-1")
    httpx.post(
        f"{fleet.router.base_url}/completions",
        headers={"X-Session-Id": "conv-2"},
        json={"prompt": "1+2=", "max_tokens": 2},
        timeout=60,
    ).raise_for_status()
    pins = redis.Redis.from_url(fleet.redis_url)
    try:
        assert pins.get(fleet.keys.sticky("conv-1")) == b"oa"
        assert pins.get(fleet.keys.sticky("conv-2")) == b"oa"
    finally:
        pins.close()


def test_version_gate_answers_503_quickly(client: openai.OpenAI) -> None:
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(
            model=NAME, prompt="1+2=", max_tokens=2, extra_body={"min_weight_version": 99}
        )
    assert refused.value.status_code == 503 and "version >= 99" in refused.value.message
    assert time.monotonic() - began < 15


def test_chat_without_template_is_a_clear_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "1+2="}])
    error = refused.value.body
    assert error["param"] == "messages" and "no chat template" in error["message"]


def test_chat_through_the_template(fleet: Fleet) -> None:
    chat = openai.OpenAI(base_url=fleet.chat_router.base_url, api_key="unused", max_retries=0)
    messages, name = [{"role": "user", "content": "12+34="}], chat.models.list().data[0].id
    answer = chat.chat.completions.create(
        model=name, messages=messages, max_tokens=4, temperature=0, logprobs=True
    )
    plain = openai.OpenAI(base_url=fleet.router.base_url, api_key="unused", max_retries=0)
    same = plain.completions.create(model=NAME, prompt="12+34=", max_tokens=4, temperature=0)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == same.choices[0].text
    assert answer.usage.prompt_tokens == 7 and len(choice.logprobs.content) >= 1
    streamed = list(
        chat.chat.completions.create(
            model=name, messages=messages, max_tokens=4, temperature=0, stream=True
        )
    )
    assert streamed[0].choices[0].delta.content == choice.message.content


BAD_HTTP = [
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 2}, "top_p"),
    ({"logprobs": 5}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"n": "many"}, "n"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"min_weight_version": -1}, "min_weight_version"),
    ({"user": "u" * 300}, "user"),
    ({"echo": True}, "echo"),
]


@pytest.mark.parametrize(("change", "param"), BAD_HTTP)
def test_bad_http_values_are_400_naming_the_field(fleet: Fleet, change: dict, param: str):
    body = {"model": NAME, "prompt": "1+2=", "max_tokens": 2, **change}
    answer = httpx.post(f"{fleet.router.base_url}/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_http_numbers_are_400(fleet: Fleet, literal: str) -> None:
    for field in ("temperature", "top_p"):
        raw = f'{{"prompt": "1+2=", "max_tokens": 2, "{field}": {literal}}}'.encode()
        answer = httpx.post(
            f"{fleet.router.base_url}/completions",
            content=raw,
            timeout=30,
            headers={"content-type": "application/json"},
        )
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field


def test_non_utf8_body_and_unknown_model(fleet: Fleet) -> None:
    raw = b'{"prompt": "1+2\xff=", "max_tokens": 2}'
    answer = httpx.post(
        f"{fleet.router.base_url}/completions",
        content=raw,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    other = httpx.post(
        f"{fleet.router.base_url}/completions",
        timeout=30,
        json={"model": "gpt-9", "prompt": "1+2="},
    )
    assert other.status_code == 404 and "gpt-9" in other.json()["error"]["message"]


# ---- gRPC: the same values at a real router and a real replica ----------------------------


def grpc_request(**changes) -> rollout_pb2.GenerateRequest:
    plain = GenerateRequest(uuid.uuid4().hex, SamplingParams(n=1, max_tokens=2), prompt_text="1+2=")
    msg = request_to_proto(plain)
    for name, value in changes.items():
        target, _, field = name.rpartition(".")
        setattr(msg.sampling if target else msg, field, value)
    return msg


BAD_GRPC = [
    ({"sampling.n": 0}, "sampling.n"),
    ({"sampling.max_tokens": 0}, "sampling.max_tokens"),
    ({"sampling.temperature": math.nan}, "sampling.temperature"),
    ({"sampling.temperature": math.inf}, "sampling.temperature"),
    ({"sampling.top_p": math.nan}, "sampling.top_p"),
    ({"sampling.top_p": 1.5}, "sampling.top_p"),
    ({"sampling.logprobs": 2}, "sampling.logprobs"),
    ({"timeout_s": math.nan}, "timeout_s"),
    ({"timeout_s": -math.inf}, "timeout_s"),
    ({"timeout_s": math.inf}, "timeout_s"),
    ({"min_weight_version": -1}, "min_weight_version"),
    ({"request_id": ""}, "request_id"),
    ({"session_id": "s" * 300}, "session_id"),
    ({"prompt_text": ""}, "prompt"),
]


@pytest.mark.parametrize("target", ["router", "replica"])
async def test_bad_grpc_values_are_invalid_argument_naming_the_field(fleet: Fleet, target: str):
    address = fleet.router.address if target == "router" else fleet.replica.address
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        for changes, field in BAD_GRPC:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(grpc_request(**changes), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (changes, refused)
            assert field in refused.value.details(), refused.value.details()
        raw = grpc_request(prompt_text="1+2=").SerializeToString().replace(b"1+2=", b"1+\xfe=")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary("/rlfleet.v1.Rollout/Generate")(raw, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_text" in refused.value.details()
        assert (await stub.Generate(grpc_request(), timeout=60)).completions  # still serving


# ---- lm-evaluation-harness as an outside client ---------------------------------------------


def test_lm_eval_local_completions_runs_offline(fleet: Fleet, tmp_path: Path) -> None:
    if shutil.which("lm_eval", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("lm-eval is not installed (pip install lm-eval)")
    model_args = (
        f"base_url={fleet.router.base_url}/completions,model={NAME},"
        "tokenizer_backend=None,tokenized_requests=False,max_retries=1,timeout=120"
    )
    offline = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "TRANSFORMERS_OFFLINE": "1",
        "OPENAI_API_KEY": "unused",
    }
    command = [
        str(Path(sys.executable).parent / "lm_eval"),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        "rlfleet_arith",
        "--include_path",
        "tests/data/lm_eval",
        "--output_path",
        str(tmp_path / "out"),
        "--batch_size",
        "1",
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=clean_env(**offline), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [results] = list((tmp_path / "out").rglob("results_*.json"))
    score = json.loads(results.read_text())["results"]["rlfleet_arith"]
    assert score["sample_len"] == 10
    assert score["exact_match,none"] == pytest.approx(greedy_accuracy(fleet))


def greedy_accuracy(fleet: Fleet) -> float:
    """The task's score computed here through the openai client: lm-eval must agree."""
    client = openai.OpenAI(base_url=fleet.router.base_url, api_key="unused", max_retries=0)
    rows = [json.loads(line) for line in TASK_DATA.read_text().splitlines()]
    texts = [
        client.completions.create(
            model=NAME, prompt=row["question"], max_tokens=6, temperature=0, stop=["\n"]
        )
        .choices[0]
        .text
        for row in rows
    ]
    return sum(t == row["answer"] for t, row in zip(texts, rows, strict=True)) / len(rows)
