"""Errors as OpenAI shapes them: ``{"error": {"message", "type", "param", "code"}}``.

Why one module: the OpenAI front and the router's own ``/metrics`` page answer errors the same
way (a client that reads one reads both), and a field named in a refusal must be the body's
name for it, not the proto's: bad input is 400 naming the field in ``param``, a missing key
401, a fleet whose queues are full 429, a fleet that cannot serve now 503, a timeout 504.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from rlfleet.common import errors

log = logging.getLogger(__name__)

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


def add_error_handlers(app: FastAPI) -> None:
    """Every error above, FastAPI's body errors and its own refusals, OpenAI-shaped."""
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_exception_handler(HTTPException, _http_error_response)
    for kind, _, _ in ERRORS:
        app.add_exception_handler(kind, error_response)


def openai_error(message: str, kind: str, param: str | None, status: int) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


async def error_response(request: Request, exc: Exception) -> JSONResponse:
    """One of ``ERRORS`` (else 500), naming the body's field that it is about."""
    status, kind = next(((s, k) for t, s, k in ERRORS if isinstance(exc, t)), (500, "server_error"))
    field, message = getattr(exc, "field", None), str(exc)
    param = PARAM_NAMES.get(field, field.removeprefix("sampling.")) if field else None
    param = getattr(exc, "param", None) or param  # a gateway session error names its field
    if field and param and message.startswith(field):  # the body's name for it, not the proto's
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
