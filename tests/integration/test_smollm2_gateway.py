"""One episode of a real instruct model through the agent gateway (issue 17, part 6).

SmolLM2-135M-Instruct (``make smollm2``), served by one hf replica behind a router's OpenAI
front, plays a three-call conversation the way a black-box ``openai``-client agent does: a
gateway session (``/rl/start_session``), ``/v1/chat/completions`` calls with ``tools`` and
``return_token_ids`` (greedy), each answer appended to the conversation with the next message
(a tool reply when the model called ``add``, else a user turn), then ``/rl/end_session``.
SmolLM2's template renders no tool schema, so its greedy answers are plain text (``12 + 34 =
48``: a 135M model's arithmetic); the tools still go through the gateway's parser.

Checked on the episode the gateway recorded: the first prompt is SmolLM2's own chat template
rendered by its tokenizer; the positions masked 1 are exactly the tokens the engine sampled,
call after call, with their log-probs and the weight version; the session is token-native
(SmolLM2's ChatML template is prefix-stable and the greedy answers re-encode to what was
sampled), so it is one record whose mask-0 positions are the template's tokens between the
answers (``<|im_end|>``, ``<|im_start|>user`` ... ``<|im_start|>assistant``), nothing sampled
among them. Skipped when SmolLM2 is not built.
"""

from __future__ import annotations

import json
import signal
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from procs import ServiceProcess
from replica_proc import ReplicaProc, start_replica, stop_replica

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.model.local_models import SMOLLM2, is_built, model_dir
from rlfleet.model.model_io import load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not is_built(model_dir(SMOLLM2)),
        reason=f"SmolLM2 is not built ({model_dir(SMOLLM2)} missing): run `make smollm2`",
    ),
]
CONTEXT = "rollout.max_model_len=1024"
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
OPENING = [{"role": "user", "content": "What is 12+34? Answer with the number."}]
FOLLOW_UPS = ["Now add 56 to it.", "And what is that minus 2?"]


@dataclass
class Gateway:
    replica: ReplicaProc
    router: ServiceProcess
    http: str  # http://host:port, no /v1
    tokenizer: Any  # SmolLM2's, to render its chat template here


@pytest.fixture(scope="module")
def gateway(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """The router starts loading while the replica starts, and the tokenizer loads here
    meanwhile (importing transformers takes seconds); then all three are waited for."""
    logs = tmp_path_factory.mktemp("smollm2_gateway")
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
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, model)
            replica = start_replica(
                url,
                keys,
                "smol",
                logs / "replica.log",
                f"model.path={model}",
                "model.dtype=bfloat16",
                "rollout.backend=hf",
                CONTEXT,
            )
        try:
            router.wait_for_line("router ready", 90)
            yield Gateway(replica, router, f"http://127.0.0.1:{http_port}", tokenizer.result())
        finally:
            stop_replica(replica, signal.SIGTERM)
    finally:
        router.stop()


def rl(gateway: Gateway, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{gateway.http}/rl/{path}", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def play(gateway: Gateway, session: str) -> list[Any]:
    """Three greedy calls in one session, as an agent appending to its conversation."""
    client = openai.OpenAI(
        base_url=f"{gateway.http}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"X-Session-ID": session},
    )
    messages: list[dict[str, Any]] = list(OPENING)
    answers = []
    for follow_up in [*FOLLOW_UPS, None]:
        answer = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            tools=[ADD],
            max_tokens=32,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        answers.append(answer)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            args = json.loads(call.function.arguments)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": str(int(args.get("a", 0)) + int(args.get("b", 0))),
                }
            )
        if follow_up is not None and not message.tool_calls:
            messages.append({"role": "user", "content": follow_up})
    return answers


def test_an_episode_of_smollm2_through_the_gateway(gateway: Gateway) -> None:
    session = rl(gateway, "start_session", {})["session_id"]
    answers = play(gateway, session)
    episode = rl(gateway, "end_session", {"session_id": session, "reward": 1.0})
    assert episode["num_calls"] == 3 and episode["reward"] == 1.0
    tokenizer = gateway.tokenizer
    rendered = tokenizer.apply_chat_template(
        OPENING, tools=[ADD], tokenize=False, add_generation_prompt=True
    )
    prompts = [answer.model_extra["prompt_token_ids"] for answer in answers]
    assert prompts[0] == tokenizer(rendered, add_special_tokens=False).input_ids
    sampled = [answer.choices[0].model_extra["token_ids"] for answer in answers]
    assert all(sampled) and all(answer.model_extra["weight_version"] == 0 for answer in answers)
    assert episode["token_native"], [answer.choices[0].message for answer in answers]
    (segment,) = episode["branches"]
    ids, mask = segment["response_ids"], segment["response_mask"]
    assert segment["prompt_ids"] == prompts[0]
    assert len(ids) == len(mask) == len(segment["response_logprobs"])
    assert [t for t, m in zip(ids, mask, strict=True) if m] == [t for s in sampled for t in s]
    logprobs = [x.logprob for answer in answers for x in answer.choices[0].logprobs.content]
    assert [lp for lp, m in zip(segment["response_logprobs"], mask, strict=True) if m] == (
        pytest.approx(logprobs)
    )
    assert {v for v, m in zip(segment["response_versions"], mask, strict=True) if m} == {0}
    assert segment["prompt_ids"] + ids == prompts[-1] + sampled[-1]  # the whole conversation
    for before, after, turn in zip(prompts, prompts[1:], sampled, strict=False):
        template = after[len(before) + len(turn) :]  # what the template put between answers
        text = tokenizer.decode(template, skip_special_tokens=False)
        assert "<|im_start|>" in text and text.endswith("<|im_start|>assistant\n"), text
    gaps = [t for t, m in zip(ids, mask, strict=True) if not m]
    assert len(gaps) == sum(
        len(a) - len(b) - len(s) for b, a, s in zip(prompts, prompts[1:], sampled, strict=False)
    )
