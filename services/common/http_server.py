"""A uvicorn server that runs inside a role's own event loop (reward and router HTTP fronts);
HTTPS when this process's ``tls`` config has a certificate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from rlfleet.common import tls
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
