"""A uvicorn server that runs inside a role's own event loop (reward and router HTTP fronts)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


class _Server(uvicorn.Server):
    """uvicorn inside our own loop: the role owns SIGTERM/SIGINT, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_http_server(app: FastAPI, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server to ``await server.serve()``; set ``should_exit`` to stop it."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)
    return _Server(config)
