"""A uvicorn server that runs inside a role's own event loop (reward and router HTTP fronts);
HTTPS when this process's ``tls`` config has a certificate; the API key check of their routes,
and an app (``guarded_app``) whose schema and docs pages are behind the key too.

With an API key set, everything but ``/healthz`` needs it: the OpenAPI schema lists every route
and field, ``/metrics`` shows traffic, model and load (Prometheus scrapers send the key with
``authorization: {credentials: KEY}``, i.e. ``Authorization: Bearer KEY``). Without one (the
loopback default) everything stays open, FastAPI's own ``/docs`` included."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from fastapi import Depends, FastAPI, Header
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from rlfleet.common import errors, tls
from rlfleet.common.config.security import TlsConfig

KEEP_ALIVE_S = 75
"""How long the server keeps an idle connection open. Longer than any client keeps one for
reuse (httpx and the ``openai`` client: 5 s), so the client always lets go first: with
uvicorn's default of 5 s both sides timed out together, and under a full step's load (256
episodes) the server closed connections just as a client sent its next request on them, which
the client saw as ``httpx.ReadError`` (an agent's ``/rl/end_session`` after ~5 s of play)."""


class _Server(uvicorn.Server):
    """uvicorn inside our own loop: the role owns SIGTERM/SIGINT, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_http_server(
    app: FastAPI, host: str, port: int, tls_config: TlsConfig | None = None
) -> uvicorn.Server:
    """A uvicorn server to ``await server.serve()``; set ``should_exit`` to stop it."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        **tls.http_options(tls_config),
    )
    return _Server(config)


def api_key_checker(api_key: str | None) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency (``Depends(api_key_checker(key))``) that refuses a request without
    ``Authorization: Bearer <key>`` (Unauthenticated); with no key set it lets every one in.
    The comparison takes the same time however much of the key matches."""

    async def check(authorization: str | None = Header(default=None)) -> None:
        if api_key is None:
            return
        if not bearer_matches(authorization, api_key):
            raise errors.Unauthenticated("missing or wrong API key (Authorization: Bearer <key>)")

    return check


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """``authorization`` is ``Bearer <api_key>``, compared in the same time however much of it
    matches (as bytes: ``compare_digest`` refuses a non-ASCII str instead of saying no)."""
    given = (authorization or "").encode("utf-8", "surrogateescape")
    return secrets.compare_digest(given, f"Bearer {api_key}".encode("utf-8", "surrogateescape"))


def bearer_wsgi(app: Callable, api_key: str | None) -> Callable:
    """A WSGI ``app`` (``prometheus_client``'s ``/metrics``) behind the same key check: 401
    without ``Authorization: Bearer <key>``; ``app`` itself when no key is set."""
    if api_key is None:
        return app

    def guarded(environ: dict, start_response: Callable) -> list[bytes]:
        if bearer_matches(environ.get("HTTP_AUTHORIZATION"), api_key):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")]
        )
        return [b"missing or wrong API key (Authorization: Bearer <key>)\n"]

    return guarded


def guarded_app(title: str, api_key: str | None) -> FastAPI:
    """A FastAPI app whose ``/openapi.json`` and ``/docs`` need ``api_key`` when it is set
    (FastAPI serves them to anyone); with no key, FastAPI's own, open."""
    if api_key is None:
        return FastAPI(title=title, version="1")
    app = FastAPI(title=title, version="1", openapi_url=None, docs_url=None, redoc_url=None)
    auth = [Depends(api_key_checker(api_key))]

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=auth, include_in_schema=False)
    async def docs() -> HTMLResponse:
        # The schema goes into the page: the page's own fetch of a URL would carry no key.
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{title} - docs",
            swagger_ui_parameters={"spec": app.openapi()},
        )

    return app
