"""The OpenAI-compatible HTTP API (FastAPI) over the fleet's generation, and the agent
gateway on it.

Why: evaluation harnesses, chat UIs and the ``openai`` client speak this API, not rlfleet's
gRPC. Underneath it is the router's generation (``Fleet``: routing, stickiness, version
gating, metrics, the same validation); only the transport differs (``openai_api`` maps the
bodies). No grpc here, and no placement: the router hosts this app (``rollout.router.http``,
which adds its own ``/metrics`` and ``/healthz``) and hands it what generates. Errors are
OpenAI-shaped (``http_errors``). When the fleet has an API key, every route needs
``Authorization: Bearer <key>`` (what the ``openai`` client sends), ``/docs`` and
``/openapi.json`` too.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``; with a
session store, the agent gateway's ``/rl/*`` (``session_routes``: sessions that record their
calls) and its chat extensions (``extensions``: ``tools`` -> ``tool_calls``,
``return_token_ids``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Header
from fastapi.responses import StreamingResponse

from rlfleet.common import errors
from rlfleet.common.http_server import api_key_checker, guarded_app
from rlfleet.rollout.gateway import extensions as gw
from rlfleet.rollout.gateway import openai_api as oai
from rlfleet.rollout.gateway.http_errors import add_error_handlers
from rlfleet.rollout.gateway.policy import Policy
from rlfleet.rollout.gateway.session_routes import Recorder, add_session_routes
from rlfleet.rollout.gateway.sessions import SessionStore
from rlfleet.rollout.types import GenerateRequest, GenerateResult

SessionHeader = Annotated[str | None, Header(alias="X-Session-Id")]


class Fleet(Protocol):
    """What the front needs of the router (``rollout.router.core.RouterCore``)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]: ...

    async def serving_version(self) -> int:
        """The newest weight version a serving replica holds (-1: none serves)."""
        ...


def create_app(
    fleet: Fleet,
    policy: Policy,
    api_key: str | None = None,
    sessions: SessionStore | None = None,
) -> FastAPI:
    """The FastAPI app over ``fleet``; ``api_key`` None leaves it open (loopback use);
    ``sessions`` None serves no ``/rl/*`` routes and records nothing."""
    app = guarded_app("rlfleet router", api_key)  # its schema and docs need the key too
    auth = [Depends(api_key_checker(api_key))]
    recorder = Recorder(sessions) if sessions is not None else None

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [await _model_card(fleet, policy)]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: oai.CompletionBody, header: SessionHeader = None) -> Any:
        session, prompts = oai.session_of(body, header), oai.prompts_of(body)
        param = await _before(recorder, session, header, len(prompts) * (body.n or 1))
        if param is None:
            _check_model(body.model, policy)
        sampling = oai.completion_sampling(body, need_logprobs=param is not None)
        started = time.perf_counter()
        results = await _generate(fleet, oai.requests_for(prompts, sampling, body, session))
        chosen = gw.choices_of(results, None, tools_on=False)
        await _after(recorder, session, param, chosen, time.perf_counter() - started)
        choices = oai.completion_choices(
            results, policy.tokenizer, body.logprobs is not None, gw.wants_token_ids(body)
        )
        return _answer("text_completion", policy, choices, results, body)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: oai.ChatBody, header: SessionHeader = None) -> Any:
        session, tools = oai.session_of(body, header), gw.tools_of(body)
        param = await _before(recorder, session, header, body.n or 1)
        if param is None:  # a session's agent may name any model: the fleet serves one
            _check_model(body.model, policy)
        token_ids = gw.wants_token_ids(body)
        messages = oai.chat_messages(body, policy.limits)  # bounded before templating
        prompt = await asyncio.to_thread(_chat_prompt, policy, messages, tools)  # off the loop
        sampling = oai.chat_sampling(
            body, len(prompt), policy.max_model_len, need_logprobs=token_ids or param is not None
        )
        started = time.perf_counter()
        results = await _generate(fleet, oai.requests_for([prompt], sampling, body, session))
        chosen = gw.choices_of(results, policy.tokenizer, tools is not None)
        await _after(recorder, session, param, chosen, time.perf_counter() - started)
        choices = gw.chat_choice_bodies(chosen, policy.tokenizer, body.logprobs, token_ids)
        extra = gw.response_token_fields(results) if token_ids else {}
        return _answer("chat.completion", policy, choices, results, body, extra)

    if sessions is not None:
        add_session_routes(app, sessions, auth)
    add_error_handlers(app)
    return app


async def _generate(fleet: Fleet, requests: list[GenerateRequest]) -> list[GenerateResult]:
    if len(requests) == 1:
        return [await fleet.generate(requests[0])]
    return await fleet.generate_batch(requests)


async def _before(
    recorder: Recorder | None, session: str, header: str | None, samples: int
) -> str | None:
    """The field naming a recorded session (None: the call is not recorded)."""
    if recorder is None:
        return None
    return await recorder.before(session, header is not None, samples)


async def _after(
    recorder: Recorder | None,
    session: str,
    param: str | None,
    chosen: list[gw.Choice],
    generate_s: float,
) -> None:
    if recorder is not None:
        records = [choice.record() for choice in chosen]
        for record in records:
            record.generate_s = generate_s
        await recorder.after(session, param, records)


def _answer(
    kind: str,
    policy: Policy,
    choices: list,
    results: list[GenerateResult],
    body: oai.Body,
    extra: dict[str, Any] | None = None,
) -> Any:
    """The response body, or its server-sent-event stream when ``stream`` asked for one."""
    head = oai.envelope(kind, policy.name, results)
    response = {**head, **(extra or {}), "choices": choices, "usage": oai.usage(results)}
    if not body.stream:
        return response
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    chunks = oai.stream_chunks(response, kind != "text_completion", include_usage)
    return StreamingResponse(_sse(chunks), media_type="text/event-stream")


async def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _chat_prompt(
    policy: Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """Token ids of the messages (and tools) through the tokenizer's chat template (clear 400
    if there is none)."""
    tokenizer = policy.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise oai.BadField(
            "messages",
            f"the policy's tokenizer ({policy.path}) has no chat "
            "template; use /v1/completions with a prompt string instead",
        )
    return gw.chat_prompt_ids(tokenizer, messages, tools)


async def _model_card(fleet: Fleet, policy: Policy) -> dict[str, Any]:
    """The policy and the newest weight version a serving replica holds (-1: none serves)."""
    return {
        "id": policy.name,
        "object": "model",
        "created": 0,
        "owned_by": "rlfleet",
        "root": policy.path,
        "weight_version": await fleet.serving_version(),
        "max_model_len": policy.max_model_len,
    }


def _check_model(model: str | None, policy: Policy) -> None:
    if model and model not in (policy.name, policy.path):
        raise errors.NotFound(
            f"model {model!r} is not served here; this router serves "
            f"{policy.name!r} (GET /v1/models)"
        )
