"""The router's HTTP apps: its own ``/metrics`` and ``/healthz``, and the OpenAI front it hosts.

Why the router hosts the front (``rlfleet.rollout.gateway``) in its own process: the front's
calls are generations like any other, and through this process's ``RouterCore`` they are
routed, gated on weight versions and counted exactly as gRPC calls are, with no extra hop.
The front's code is a package of its own (body mapping, tool calls, agent sessions); what
stays here is what the router serves about itself: Prometheus ``/metrics`` (behind the API
key when one is set: scrapers send it as ``Authorization: Bearer``) and ``/healthz`` (Redis
answers; always open). ``app.http_front`` serves one of these apps when a port is set.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.asyncio import Redis

from rlfleet.common import errors
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.http_server import api_key_checker, guarded_app
from rlfleet.rollout.gateway.app import create_app
from rlfleet.rollout.gateway.http_errors import error_response
from rlfleet.rollout.gateway.policy import load_policy
from rlfleet.rollout.gateway.sessions import SessionStore
from rlfleet.rollout.router.core import RouterCore


def front_app(core: RouterCore, config: RlfleetConfig, redis: Redis | None = None) -> FastAPI:
    """The OpenAI front over ``core`` (with ``redis``, also the agent gateway: sessions in
    that Redis), plus this router's ``/metrics`` and ``/healthz``."""
    sessions = None if redis is None else SessionStore.for_config(redis, config)
    app = create_app(core, load_policy(config), config.api_key, sessions)
    add_service_routes(app, core, [Depends(api_key_checker(config.api_key))])
    return app


def metrics_app(core: RouterCore, api_key: str | None = None) -> FastAPI:
    """Only ``/metrics`` and ``/healthz``: for a router without the OpenAI front."""
    app = guarded_app("rlfleet router metrics", api_key)
    add_service_routes(app, core, [Depends(api_key_checker(api_key))])
    app.add_exception_handler(errors.Unauthenticated, error_response)
    return app


def add_service_routes(app: FastAPI, core: RouterCore, auth: list[Any]) -> None:
    """``/metrics`` (Prometheus text, behind ``auth``) and ``/healthz`` (always open)."""

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return Response(await core.scrape_metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        await core.list_replicas()
        return {"status": "ok"}
