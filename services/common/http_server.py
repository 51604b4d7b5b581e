"""A uvicorn server that runs inside a role's own event loop (reward and router HTTP fronts);
HTTPS when this process's ``tls`` config has a certificate (a client certificate required with
``tls.client_auth``); a WSGI server for a replica's ``/metrics``, held to the same TLS; the
API key check of their routes, and an app (``guarded_app``) whose schema and docs pages are
behind the key too.

With an API key set, everything but ``/healthz`` needs it: the OpenAPI schema lists every route
and field, ``/metrics`` shows traffic, model and load (Prometheus scrapers send the key with
``authorization: {credentials: KEY}``, i.e. ``Authorization: Bearer KEY``). Without one (the
loopback default) everything stays open, FastAPI's own ``/docs`` included."""

from __future__ import annotations

import contextlib
import secrets
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

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


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    """One thread per request, none outliving the process (as ``prometheus_client``'s own
    ``start_http_server`` does)."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A refused TLS handshake (no client certificate, another CA) is the client's
        problem: no traceback on the role's output."""
        if not isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError):
            super().handle_error(request, client_address)


class _QuietHandler(WSGIRequestHandler):
    """No access line per request (a scrape every few seconds) on the role's output."""

    def log_message(self, *args: object) -> None:
        pass

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):  # in this thread, not the accepting one
            self.request.do_handshake()
        super().setup()


def start_wsgi_server(
    app: Callable, host: str, port: int, name: str, tls_config: TlsConfig | None = None
) -> WSGIServer:
    """Serve a WSGI ``app`` (a replica's ``/metrics``) from a daemon thread named ``name``;
    HTTPS as every other door when this process's ``tls`` config (or ``tls_config``) has a
    certificate. ``server.shutdown()`` stops it."""
    server = make_server(host, port, app, _ThreadingWSGIServer, handler_class=_QuietHandler)
    context = tls.server_ssl_context(tls_config)
    if context is not None:  # each connection's handshake runs in its own request thread
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


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
