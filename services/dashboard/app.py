"""The dashboard's HTTP side: the page, its JSON document, and the process around them.

Routes: ``GET /`` the page (``page.html``: no data in it, so it is served without the key, and
asks for the key when the fleet has one); ``GET /api/state`` the latest document (needs
``Authorization: Bearer <key>`` when ``api_key`` is set: 401 and no data without it);
``GET /healthz``. The page sends the key it was opened with (``/?key=...``, then kept in the
tab's sessionStorage and dropped from the address bar) as that header.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from rlfleet.common import errors, tls
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.http_server import api_key_checker, make_http_server
from rlfleet.dashboard.state import DashboardState

log = logging.getLogger(__name__)


def page_html(refresh_s: float) -> str:
    text = resources.files("rlfleet.dashboard").joinpath("page.html").read_text("utf-8")
    return text.replace("__REFRESH_MS__", str(int(refresh_s * 1000)))


def create_app(state: DashboardState, api_key: str | None) -> FastAPI:
    """The app over ``state`` (whose ``document`` the background loop keeps fresh while it is
    read)."""
    app = FastAPI(title="rlfleet dashboard", version="1", docs_url=None, redoc_url=None)
    auth = [Depends(api_key_checker(api_key))]
    page = page_html(state.config.dashboard.refresh_s)

    @app.exception_handler(errors.Unauthenticated)
    async def unauthenticated(_: Request, exc: errors.Unauthenticated) -> JSONResponse:
        return JSONResponse(
            {"error": str(exc)}, status_code=401, headers={"WWW-Authenticate": "Bearer"}
        )

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return page

    @app.get("/api/state", dependencies=auth)
    async def document() -> dict[str, Any]:
        return await state.latest()

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    return app


def bound_port(server) -> int:
    return int(server.servers[0].sockets[0].getsockname()[1])


async def serve(config: RlfleetConfig) -> None:
    """Run the dashboard until SIGTERM/SIGINT: probe loop + HTTP server."""
    from rlfleet.common.endpoints import describe, read_endpoints, write_endpoints

    metrics_urls = replica_metrics_urls(read_endpoints(config.run_dir))
    from rlfleet.dashboard.probe import FleetProbe

    state = DashboardState(config, FleetProbe(config, metrics_urls))
    dash = config.dashboard
    server = make_http_server(create_app(state, config.api_key), dash.host, dash.port, config.tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    refresher = asyncio.create_task(state.run())
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if serving.done():
        serving.result()  # the bind failed: say why
    scheme = tls.scheme(config.tls)
    addresses = {"http": f"{scheme}://{dash.host}:{bound_port(server)}/"}
    write_endpoints(config.run_dir, "dashboard", addresses)
    log.info("%s", describe("dashboard", addresses))
    await asyncio.wait(
        [serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED
    )
    server.should_exit = True
    refresher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await refresher
    await serving
    await state.close()


def replica_metrics_urls(endpoints: dict[str, dict[str, str]]) -> dict[str, str]:
    """Replica id -> ``/metrics`` URL, for replicas whose launcher recorded one."""
    return {
        role: entry["metrics"]
        for role, entry in endpoints.items()
        if role.startswith("rollout-") and "metrics" in entry
    }
