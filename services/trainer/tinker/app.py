"""The Tinker API's HTTP routes (the SDK's paths under ``/api/v1``): bodies <-> core calls.

Every route but ``/api/v1/healthz`` needs the API key when one is set: the SDK sends it as
``X-API-Key`` (``Authorization: Bearer`` works too). A path the SDK may call that this server
does not offer answers 404 naming it. Errors are ``{"detail": message}`` with 400 (bad input or
an unsupported feature, named), 401, 404, 503 (retryable) or 500.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlfleet.common import errors
from rlfleet.common.errors import InvalidArgument
from rlfleet.trainer.tinker import convert
from rlfleet.trainer.tinker.futures import Done, Failed, Pending
from rlfleet.trainer.tinker.service import TinkerService
from rlfleet.trainer.tinker.types import ForwardResult, Saved

log = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
PINNED_SDK = "0.38.0"
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": True,
    "parallel_fwdbwd_chunks": True,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}
"""The SDK's feature flags: the plain API-key, JSON-polling paths this server implements.

``use_pyqwest_transport``: the SDK's HTTP client on pyqwest (reqwest, in Rust) instead of
httpx's pure-Python transport. Profiled under bench/bench_tinker.py's sampling round (16
``sample`` calls), the SDK's thread was busy 30% of the time instead of 47%, and the calls
reached the server close enough together to go to the router as 1.9 batches instead of 5.8.
Over HTTPS it is off (``create_app``): pyqwest trusts only the system's
certificate roots, not a fleet's own CA named by ``SSL_CERT_FILE`` as httpx does."""
STATUS: list[tuple[type[Exception] | tuple[type[Exception], ...], int]] = [
    (errors.Unauthenticated, 401),
    (errors.NotFound, 404),
    (errors.InvalidArgument, 400),
    (errors.FailedPrecondition, 400),
    (errors.Unavailable, 503),
    ((KeyError, ValueError, TypeError), 400),
]
"""HTTP status by exception; a body without a field the SDK always sends, or with a value of
the wrong type, is bad input (400: the SDK does not retry it), not a server error."""
USER_ERRORS = (errors.InvalidArgument, errors.NotFound, errors.FailedPrecondition)


def create_app(service: TinkerService, api_key: str | None, https: bool = False) -> FastAPI:
    app = FastAPI(
        title="rlfleet Tinker API", version="1", openapi_url=None, docs_url=None, redoc_url=None
    )
    if api_key is not None:
        app.add_middleware(KeyCheck, api_key=api_key)
    _session_routes(app, service, {**CLIENT_CONFIG, "use_pyqwest_transport": not https})
    _training_routes(app, service)
    _sampling_routes(app, service)
    _future_routes(app, service)

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def unsupported(request: Request, rest: str) -> JSONResponse:
        return JSONResponse(
            {
                "detail": f"{request.method} /api/v1/{rest} is not supported by "
                "this server (rlfleet's Tinker API; docs/tinker.md)"
            },
            status_code=404,
        )

    app.add_exception_handler(Exception, _error)
    return app


class KeyCheck:
    """The API key on every route but ``healthz``, as plain ASGI.

    Why not ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` runs each request
    in a task group of its own and streams its answer back through a memory channel; profiled
    under the SDK's training loop, that was the largest part of the event loop's time per
    request, and that time holds the GIL the compute thread needs (bench/bench_tinker.py)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/api/v1/healthz":
            headers = dict(scope["headers"])
            given = headers.get(b"x-api-key") or headers.get(b"authorization", b"")
            if not secrets.compare_digest(given.removeprefix(b"Bearer "), self.key):
                refusal = JSONResponse({"detail": "missing or wrong API key (X-API-Key)"}, 401)
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def _session_routes(app: FastAPI, service: TinkerService, client: dict[str, Any]) -> None:
    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return client

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        served = service.served
        model = {
            "model_name": served.name,
            "max_context_length": served.max_context,
            "trainable": True,
            "sampleable": True,
        }
        return {"supported_models": [model]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        body = await request.json()
        version = body.get("sdk_version")
        warning = (
            None
            if version == PINNED_SDK
            else (f"this server is tested with tinker {PINNED_SDK}; you run {version}")
        )
        return {
            "type": "create_session",
            "session_id": service.create_session(),
            "warning_message": warning,
        }

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, str]:
        service.session((await request.json())["session_id"])
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict[str, str]:
        service.finish_session(session_id)
        return {}


def _training_routes(app: FastAPI, service: TinkerService) -> None:
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        body = await request.json()
        request_id = service.create_model(
            body["session_id"],
            int(body["model_seq_id"]),
            body["base_model"],
            convert.lora_spec(body),
        )
        return {
            "request_id": request_id,
            "model_id": f"{body['session_id']}:train:{body['model_seq_id']}",
        }

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        info = service.info((await request.json())["model_id"])
        return {
            "type": "get_info",
            "model_id": info.model_id,
            "is_lora": True,
            "lora_rank": info.lora_rank,
            "model_name": info.model_name,
            "model_data": {
                "arch": info.arch,
                "model_name": info.model_name,
                "tokenizer_id": info.tokenizer_id,
            },
        }

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        if PROTO not in request.headers.get("content-type", ""):
            raise InvalidArgument(f"forward_backward takes a {PROTO} body (as the SDK sends)")
        if request.headers.get("content-encoding"):
            raise InvalidArgument("compressed forward_backward bodies are not supported")
        call = convert.forward_call(await request.body())
        request_id = service.forward_backward(
            call.model_id, call.seq_id, call.data, call.loss_fn, call.config, call.forward_only
        )
        return {"request_id": request_id, "model_id": call.model_id}

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        body = await request.json()
        rid = service.optim_step(body["model_id"], body.get("seq_id"), convert.adam_step(body))
        return {"request_id": rid, "model_id": body["model_id"]}

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        body = await request.json()
        rid = service.save_state(
            body["model_id"],
            body.get("seq_id"),
            body.get("path") or "",
            bool(body.get("overwrite")),
            body.get("ttl_seconds"),
        )
        return {"request_id": rid, "model_id": body["model_id"]}

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await request.json()
        if body.get("model_id") is None:
            raise InvalidArgument(
                "create_training_client_from_state is not supported yet: "
                "create a LoRA training client, then load_state"
            )
        rid = service.load_state(
            body["model_id"], body.get("seq_id"), body["path"], bool(body.get("optimizer"))
        )
        return {"request_id": rid, "model_id": body["model_id"]}

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        body = await request.json()
        if body.get("kind", "snapshot") != "snapshot":
            raise InvalidArgument(
                f"sampling client kind {body['kind']!r} is not supported (snapshot only)"
            )
        rid = service.save_for_sampler(
            body["model_id"], body.get("seq_id"), body.get("path"), body.get("ttl_seconds")
        )
        return {"request_id": rid, "model_id": body["model_id"]}


def _sampling_routes(app: FastAPI, service: TinkerService) -> None:
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await request.json()
        sampler = service.create_sampling_session(
            body["session_id"], body.get("base_model"), body.get("model_path")
        )
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        base, path = service.sampler_info(sampler_id)
        return {"sampler_id": sampler_id, "base_model": base, "model_path": path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await request.json()
        sampler = body.get("sampling_session_id")
        if sampler is None:
            raise InvalidArgument("sample needs a sampling_session_id (create a SamplingClient)")
        spec = convert.sample_spec(body, set(service.served.eos_ids))
        rid = service.sample(sampler, body.get("seq_id"), spec)
        ids = [f"{rid}:{i}" for i in range(spec.num_samples)]
        return {"request_id": rid, "sample_sequence_ids": ids}


def _future_routes(app: FastAPI, service: TinkerService) -> None:
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id = (await request.json())["request_id"]
        outcome = await service.futures.retrieve(request_id)
        if isinstance(outcome, Pending):
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        if isinstance(outcome, Failed):
            user = isinstance(outcome.error, USER_ERRORS)
            return JSONResponse(
                {"error": str(outcome.error), "category": "user" if user else "server"}
            )
        return _answer(outcome, PROTO in request.headers.get("accept", ""))


def _answer(outcome: Done, proto: bool) -> Response:
    value = outcome.value
    if isinstance(value, ForwardResult):
        if proto:
            return Response(convert.forward_output(value), media_type=PROTO)
        return JSONResponse(convert.forward_json(value))
    if isinstance(value, list):  # sampled sequences
        if proto:
            return Response(convert.sample_response(value), media_type=PROTO)
        return JSONResponse(convert.sequences_json(value))
    if isinstance(value, Saved):
        return JSONResponse({k: v for k, v in vars(value).items() if v is not None})
    if isinstance(value, str):  # create_model's model id
        return JSONResponse({"type": "create_model", "model_id": value})
    return JSONResponse({"metrics": value})  # optim_step


async def _error(request: Request, exc: Exception) -> JSONResponse:
    status = next((code for kind, code in STATUS if isinstance(exc, kind)), 500)
    log.log(
        logging.ERROR if status == 500 else logging.INFO,
        "HTTP %s %s -> %d: %s: %s",
        request.method,
        request.url.path,
        status,
        type(exc).__name__,
        exc,
    )
    detail = str(exc) if isinstance(exc, errors.RlfleetError) else f"{type(exc).__name__}: {exc}"
    return JSONResponse({"detail": detail}, status_code=status)
