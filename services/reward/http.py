"""The reward service's HTTP front door (FastAPI), for tools that do not speak gRPC.

Same core and same validation as gRPC; only the transport differs. When the fleet has an API
key, every route except ``/healthz`` needs ``Authorization: Bearer <key>``: reward servers
reachable from a network must not score for anyone who asks.

Routes: ``POST /score`` and ``/score_batch`` (rlfleet's ScoreRequest JSON; ``id`` optional;
also under ``/v1/score``, ``/v1/score/batch``), ``GET /scorers`` (``/v1/scorers``),
``GET /healthz`` (always open), ``GET /metrics`` (Prometheus; with an API key, scrapers send
it, like ``/docs`` and ``/openapi.json`` need it), and two for other frameworks' remote reward calls
(``compat``): ``POST /get_reward`` (OpenRLHF) and ``POST /slime/reward`` (slime).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from redis.exceptions import RedisError

from rlfleet.common import errors
from rlfleet.common.http_server import api_key_checker, guarded_app
from rlfleet.reward import compat
from rlfleet.reward.service import RewardService
from rlfleet.reward.types import ScoreRequest

log = logging.getLogger(__name__)

JsonObject = Annotated[dict[str, Any], Body()]


class ScoreBody(BaseModel):
    """One response to score (the OpenAPI schema of ``/score``; ``ScoreRequest.from_dict`` is
    what validates, so gRPC, HTTP and JSONL callers get the same errors)."""

    id: str | None = Field(None, description="Request id; left out, the item's position.")
    data_source: str = Field("", description="Dataset name (verl's); picks the scorer.")
    solution_str: str = Field(description="The response text to score.")
    ground_truth: Any = Field("", description="Any JSON value, handed to the scorer as is.")
    extra_info: dict[str, Any] = Field(default_factory=dict, description="Passed to scorers.")
    scorer: str | None = Field(None, description="A scorer name; overrides data_source.")
    prompt: str = Field("", description="The prompt, for scorers that read it.")


def documented(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` showing ``schema`` as the JSON body of a route that takes a raw dict."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


SCORE_SCHEMA = ScoreBody.model_json_schema()
BATCH_SCHEMA = {
    "title": "ScoreBatch",
    "type": "object",
    "properties": {"requests": {"type": "array", "items": SCORE_SCHEMA}},
    "required": ["requests"],
}


STATUS_BY_ERROR: list[tuple[type[Exception], int]] = [
    (errors.Unauthenticated, 401),
    (errors.NotFound, 404),
    (errors.FailedPrecondition, 409),
    (errors.InvalidArgument, 400),
    (errors.Unavailable, 503),
    (RedisError, 503),
    (TimeoutError, 504),
]


def create_app(service: RewardService, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; ``api_key`` None leaves it open (loopback use)."""
    app = guarded_app("rlfleet reward", api_key)  # its schema and docs need the key too
    auth = [Depends(api_key_checker(api_key))]

    @app.post("/v1/score", dependencies=auth, openapi_extra=documented(SCORE_SCHEMA))
    @app.post("/score", dependencies=auth, openapi_extra=documented(SCORE_SCHEMA))
    async def score(body: JsonObject) -> dict[str, Any]:
        return (await service.score(ScoreRequest.from_dict(body))).to_dict()

    @app.post("/v1/score/batch", dependencies=auth, openapi_extra=documented(BATCH_SCHEMA))
    @app.post("/score_batch", dependencies=auth, openapi_extra=documented(BATCH_SCHEMA))
    async def score_batch(body: JsonObject) -> dict[str, Any]:
        results = await service.score_batch(_batch_items(body))
        return {"results": [result.to_dict() for result in results]}

    @app.get("/v1/scorers", dependencies=auth)
    @app.get("/scorers", dependencies=auth)
    async def scorers() -> dict[str, Any]:
        return {"scorers": [info.to_dict() for info in service.list_scorers()]}

    add_compat_routes(app, service, auth)

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        if not await service.healthy():
            raise errors.Unavailable("Redis does not answer")
        return {"status": "ok"}

    app.add_exception_handler(errors.RlfleetError, _error_response)
    app.add_exception_handler(TimeoutError, _error_response)
    app.add_exception_handler(RedisError, _error_response)
    return app


def add_compat_routes(app: FastAPI, service: RewardService, auth: list[Any]) -> None:
    """OpenRLHF's and slime's remote reward routes (see ``rlfleet.reward.compat``)."""
    default = service.default_scorer

    @app.post("/get_reward", dependencies=auth)
    async def get_reward(body: JsonObject) -> dict[str, Any]:
        results = await service.score_batch(compat.openrlhf_requests(body, default))
        return compat.openrlhf_reply(results)

    @app.post("/slime/reward", dependencies=auth)
    async def slime_reward(body: JsonObject, detail: bool = Query(False)) -> Any:
        result = (await service.score_batch([compat.slime_request(body, default)]))[0]
        if result.error:
            return JSONResponse({"error": result.error}, status_code=422)
        return compat.slime_reply(result, detail)


def _batch_items(body: dict[str, Any]) -> list[ScoreRequest]:
    items = body.get("requests")
    if not isinstance(items, list) or set(body) != {"requests"}:
        raise errors.InvalidArgument('body must be {"requests": [ScoreRequest, ...]}')
    return [ScoreRequest.from_dict(item) for item in items]


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    status = next((code for kind, code in STATUS_BY_ERROR if isinstance(exc, kind)), 500)
    log.warning("HTTP %s %s -> %d: %s", request.method, request.url.path, status, exc)
    return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=status)
