"""A uvicorn server that runs inside a role's own event loop (reward and router HTTP fronts);
HTTPS when this process's ``tls`` config has a certificate; the API key check of their routes."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from fastapi import FastAPI, Header

from rlfleet.common import errors, tls
from rlfleet.common.config.security import TlsConfig


class _Server(uvicorn.Server):
    """uvicorn inside our own loop: the role owns SIGTERM/SIGINT, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_http_server(
    app: FastAPI, host: str, port: int, tls_config: TlsConfig | None = None
) -> uvicorn.Server:
    """A uvicorn server to ``await server.serve()``; set ``should_exit`` to stop it."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            **tls.http_options(tls_config))  # fmt: skip
    return _Server(config)


def api_key_checker(api_key: str | None) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency (``Depends(api_key_checker(key))``) that refuses a request without
    ``Authorization: Bearer <key>`` (Unauthenticated); with no key set it lets every one in.
    The comparison takes the same time however much of the key matches."""

    async def check(authorization: str | None = Header(default=None)) -> None:
        if api_key is None:
            return
        if not secrets.compare_digest(authorization or "", f"Bearer {api_key}"):
            raise errors.Unauthenticated("missing or wrong API key (Authorization: Bearer <key>)")

    return check
