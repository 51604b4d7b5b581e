"""The router's OpenAI-compatible HTTP front door (FastAPI), plus Prometheus ``/metrics``.

Why: evaluation harnesses, chat UIs and the ``openai`` client speak this API, not rlfleet's
gRPC. Underneath it is the same ``RouterCore`` (routing, stickiness, version gating, metrics)
and the same validation; only the transport differs (``openai_api`` maps the bodies). No grpc
here. Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): bad
input is 400 naming the field in ``param``, a fleet whose queues are full 429, a fleet that
cannot serve now 503, a timeout 504.
When the fleet has an API key, every route but ``/healthz`` needs ``Authorization: Bearer
<key>`` (what the ``openai`` client sends), ``/metrics``, ``/docs`` and ``/openapi.json`` too.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /metrics``, ``GET /healthz``; with a session store, the agent gateway's ``/rl/*``
(``gateway.py``: sessions that record their calls) and its chat extensions (``gateway_api``:
``tools`` -> ``tool_calls``, ``return_token_ids``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from rlfleet.common import errors
from rlfleet.common.http_server import api_key_checker, guarded_app
from rlfleet.rollout.router import gateway_api as gw
from rlfleet.rollout.router import openai_api as oai
from rlfleet.rollout.router.core import RouterCore
from rlfleet.rollout.router.gateway import Recorder, add_session_routes
from rlfleet.rollout.router.sessions import SessionStore
from rlfleet.rollout.types import GenerateRequest, GenerateResult, ReplicaState

log = logging.getLogger(__name__)

SessionHeader = Annotated[str | None, Header(alias="X-Session-Id")]
ERRORS: list[tuple[type[BaseException], int, str]] = [
    (errors.InvalidArgument, 400, "invalid_request_error"),
    (errors.Unauthenticated, 401, "authentication_error"),
    (errors.NotFound, 404, "not_found_error"),
    (errors.FailedPrecondition, 409, "conflict_error"),
    (errors.ResourceExhausted, 429, "rate_limit_error"),
    (errors.Unavailable, 503, "service_unavailable"),
    (RedisError, 503, "service_unavailable"),
    (TimeoutError, 504, "timeout"),
]
PARAM_NAMES = {"prompt_text": "prompt", "prompt_token_ids": "prompt", "session_id": "user"}


def create_app(
    core: RouterCore, policy: oai.Policy, api_key: str | None = None,
    sessions: SessionStore | None = None,
) -> FastAPI:  # fmt: skip
    """The FastAPI app over ``core``; ``api_key`` None leaves it open (loopback use);
    ``sessions`` None serves no ``/rl/*`` routes and records nothing."""
    app = guarded_app("rlfleet router", api_key)  # its schema and docs need the key too
    auth = [Depends(api_key_checker(api_key))]
    recorder = Recorder(sessions) if sessions is not None else None

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [await _model_card(core, policy)]}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: oai.CompletionBody, header: SessionHeader = None) -> Any:
        session, prompts = oai.session_of(body, header), oai.prompts_of(body)
        param = await _before(recorder, session, header, len(prompts) * (body.n or 1))
        if param is None:
            _check_model(body.model, policy)
        sampling = oai.completion_sampling(body, need_logprobs=param is not None)
        started = time.perf_counter()
        results = await _generate(core, oai.requests_for(prompts, sampling, body, session))
        chosen = gw.choices_of(results, None, tools_on=False)
        await _after(recorder, session, param, chosen, time.perf_counter() - started)
        choices = oai.completion_choices(results, policy.tokenizer, body.logprobs is not None,
                                         gw.wants_token_ids(body))  # fmt: skip
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
        sampling = oai.chat_sampling(body, len(prompt), policy.max_model_len,
                                     need_logprobs=token_ids or param is not None)  # fmt: skip
        started = time.perf_counter()
        results = await _generate(core, oai.requests_for([prompt], sampling, body, session))
        chosen = gw.choices_of(results, policy.tokenizer, tools is not None)
        await _after(recorder, session, param, chosen, time.perf_counter() - started)
        choices = gw.chat_choice_bodies(chosen, policy.tokenizer, body.logprobs, token_ids)
        extra = gw.response_token_fields(results) if token_ids else {}
        return _answer("chat.completion", policy, choices, results, body, extra)

    if sessions is not None:
        add_session_routes(app, sessions, auth)
    add_service_routes(app, core, auth)
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_exception_handler(HTTPException, _http_error_response)
    for kind, _, _ in ERRORS:
        app.add_exception_handler(kind, _error_response)
    return app


def add_service_routes(app: FastAPI, core: RouterCore, auth: list) -> None:
    """``/metrics`` (Prometheus text; behind the API key when one is set: scrapers send it as
    ``Authorization: Bearer``) and ``/healthz`` (Redis answers; always open)."""

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return Response(await core.scrape_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        await core.list_replicas()
        return {"status": "ok"}


def metrics_app(core: RouterCore, api_key: str | None = None) -> FastAPI:
    """Only ``/metrics`` and ``/healthz``: for a router without the OpenAI front."""
    app = guarded_app("rlfleet router metrics", api_key)
    add_service_routes(app, core, [Depends(api_key_checker(api_key))])
    app.add_exception_handler(errors.Unauthenticated, _error_response)
    return app


async def _generate(core: RouterCore, requests: list[GenerateRequest]) -> list[GenerateResult]:
    if len(requests) == 1:
        return [await core.generate(requests[0])]
    return await core.generate_batch(requests)


async def _before(recorder: Recorder | None, session: str, header: str | None,
                  samples: int) -> str | None:  # fmt: skip
    """The field naming a recorded session (None: the call is not recorded)."""
    if recorder is None:
        return None
    return await recorder.before(session, header is not None, samples)


async def _after(recorder: Recorder | None, session: str, param: str | None,
                 chosen: list[gw.Choice], generate_s: float) -> None:  # fmt: skip
    if recorder is not None:
        records = [choice.record() for choice in chosen]
        for record in records:
            record.generate_s = generate_s
        await recorder.after(session, param, records)


def _answer(
    kind: str, policy: oai.Policy, choices: list, results: list[GenerateResult], body: oai.Body,
    extra: dict[str, Any] | None = None,
) -> Any:  # fmt: skip
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
    policy: oai.Policy, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """Token ids of the messages (and tools) through the tokenizer's chat template (clear 400
    if there is none)."""
    tokenizer = policy.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise oai.BadField("messages", f"the policy's tokenizer ({policy.path}) has no chat "
                           "template; use /v1/completions with a prompt string instead")  # fmt: skip
    return gw.chat_prompt_ids(tokenizer, messages, tools)


async def _model_card(core: RouterCore, policy: oai.Policy) -> dict[str, Any]:
    """The policy and the newest weight version a serving replica holds (-1: none serves)."""
    views = await core.list_replicas()
    serving = [v.info.weight_version for v in views if v.state is ReplicaState.SERVING]
    return {"id": policy.name, "object": "model", "created": 0, "owned_by": "rlfleet",
            "root": policy.path, "weight_version": max(serving, default=-1),
            "max_model_len": policy.max_model_len}  # fmt: skip


def _check_model(model: str | None, policy: oai.Policy) -> None:
    if model and model not in (policy.name, policy.path):
        raise errors.NotFound(f"model {model!r} is not served here; this router serves "
                              f"{policy.name!r} (GET /v1/models)")  # fmt: skip


def openai_error(message: str, kind: str, param: str | None, status: int) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    status, kind = next(((s, k) for t, s, k in ERRORS if isinstance(exc, t)), (500, "server_error"))
    field, message = getattr(exc, "field", None), str(exc)
    param = PARAM_NAMES.get(field, field.removeprefix("sampling.")) if field else None
    param = getattr(exc, "param", None) or param  # a gateway session error names its field
    if field and message.startswith(field):  # the body's name for it, not the proto's
        message = param + message[len(field) :]
    log.warning("HTTP %s %s -> %d: %s", request.method, request.url.path, status, message)
    return openai_error(message, kind, param, status)


async def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's body errors (wrong types, unreadable JSON) as a 400 naming the field."""
    first = exc.errors()[0] if exc.errors() else {}
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(where) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid request body')}"
    log.warning("HTTP %s %s -> 400: %s", request.method, request.url.path, message)
    return openai_error(message, "invalid_request_error", param, 400)


async def _http_error_response(request: Request, exc: HTTPException) -> JSONResponse:
    """FastAPI's own refusals (an unreadable body: not UTF-8, not JSON; unknown routes)."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    if exc.status_code == 400:
        message = f"the request body is not valid UTF-8 JSON ({exc.detail})"
    else:
        message = str(exc.detail)
    return openai_error(message, kind, None, exc.status_code)
