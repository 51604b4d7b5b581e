"""The router process assembled: its core (with the janitor), the gRPC server, the HTTP server.

The router holds no state of its own (it all lives in Redis), so it can be restarted or run
several times side by side. With ``router.http_port`` set it also hosts the OpenAI-compatible
HTTP API and the agent gateway (``rlfleet.rollout.gateway``) beside its ``/metrics``
(``http.py``); with only ``router.metrics_port``, just ``/metrics``. FastAPI and the policy's
tokenizer are imported only when the HTTP server is on.

``rlfleet.rollout.router.main`` parses the command line and calls ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.grpc_server import GrpcServer, install_stop_signals
from rlfleet.common.keys import Keys
from rlfleet.common.redis_client import connect
from rlfleet.rollout.router.core import RouterCore
from rlfleet.rollout.router.server import registrations

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger(__name__)


def run(config: RlfleetConfig, port: int) -> None:
    """Serve on gRPC ``port`` until SIGTERM/SIGINT."""
    asyncio.run(serve(config, port))


async def serve(config: RlfleetConfig, port: int) -> None:
    """Run the gRPC server and the janitor until a stop signal arrives."""
    # No socket timeout: redis-py's default (5 s) wraps every write in asyncio.wait_for, which
    # on Python 3.11 can swallow task cancellation; keepalive and health checks catch dead links.
    redis = connect(config.require_redis_url())
    core = RouterCore(redis, Keys(config.cluster), config)
    server = GrpcServer(
        registrations(core), config.router.host, port, config.max_message_mb, config.api_key
    )
    stop = asyncio.Event()
    install_stop_signals(stop)
    await server.start()
    core.start()
    try:
        async with http_front(core, config, redis) as http_url:
            log.info(
                "router ready on %s:%d (cluster %s)%s",
                config.router.host,
                server.port,
                config.cluster,
                f", HTTP at {http_url}" if http_url else "",
            )
            await stop.wait()
            log.info("router stopping")
    finally:
        await server.stop()
        await core.close()
        await redis.aclose()


@contextlib.asynccontextmanager
async def http_front(
    core: RouterCore, config: RlfleetConfig, redis: Redis | None = None
) -> AsyncIterator[str | None]:
    """The HTTP server (OpenAI API + /metrics, or /metrics alone) while the block runs; the
    block gets its URL (None: no HTTP server), which the ready line names. With ``redis`` the
    OpenAI API is also the agent gateway (sessions in that Redis)."""
    from rlfleet.common.http_server import make_http_server
    from rlfleet.rollout.router import http

    cfg = config.router
    if cfg.http_port is None and cfg.metrics_port is None:
        yield None
        return
    if cfg.http_port is not None:
        app, port = http.front_app(core, config, redis), cfg.http_port
    else:
        app, port = http.metrics_app(core, config.api_key), cfg.metrics_port or 0
    server = make_http_server(app, cfg.host, port or _free_port())
    task = asyncio.create_task(server.serve(), name="router-http")
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if task.done():
        task.result()
        raise OSError(f"router HTTP server on {cfg.host}:{port} did not start")
    url = f"{tls.scheme()}://{cfg.host}:{server.config.port}"
    url += "/v1" if cfg.http_port is not None else "/metrics"
    try:
        yield url
    finally:
        server.should_exit = True
        await task


def _free_port() -> int:
    from rlfleet.common.ports import free_port

    return free_port()
