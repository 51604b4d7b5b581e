"""Start a real router process with its HTTP front (OpenAI API + /metrics) for tests.

Launched as ``python -m rlfleet.rollout.router.main`` on free ports; ready once it logs
"router ready" (which it does only after the HTTP server is up). Stopped through the shared
``procs.ServiceProcess`` (its own PID and group only).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from procs import ServiceProcess, start_and_wait
from replica_proc import MODEL

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import free_port


@dataclass
class RouterProc:
    proc: ServiceProcess
    address: str  # gRPC host:port
    http: str  # http://host:port (no /v1)

    @property
    def base_url(self) -> str:
        """What the ``openai`` client takes as ``base_url``."""
        return f"{self.http}/v1"


def router_argv(redis_url: str, cluster: str, port: int, *extra: str) -> list[str]:
    """``python -m rlfleet.rollout.router.main`` serving gRPC on ``port`` for ``cluster``, its
    janitor every 0.3 s (tests wait on what it requeues)."""
    return [
        sys.executable,
        "-m",
        "rlfleet.rollout.router.main",
        "--port",
        str(port),
        f"redis_url={redis_url}",
        f"cluster={cluster}",
        "router.janitor_interval_s=0.3",
        *extra,
    ]


def start_router(
    redis_url: str, keys: Keys, log_path: Path, *extra: str, ready_s: float = 60
) -> tuple[ServiceProcess, str]:
    """A router process (gRPC only unless ``extra`` says otherwise), once it is ready, and the
    address it serves at."""
    port = free_port()
    command = router_argv(redis_url, keys.cluster, port, *extra)
    router = start_and_wait(command, log_path, lambda p: p.wait_for_line("router ready", ready_s))
    return router, f"127.0.0.1:{port}"


def start_http_router(
    redis_url: str,
    keys: Keys,
    log_path: Path,
    *extra: str,
    model: Path = MODEL,
    ready_s: float = 60,
) -> RouterProc:
    """A router with its OpenAI front too (it loads ``model``'s tokenizer)."""
    http_port = free_port()
    http = (f"model.path={model}", f"router.http_port={http_port}")
    proc, address = start_router(redis_url, keys, log_path, *http, *extra, ready_s=ready_s)
    return RouterProc(proc, address, f"http://127.0.0.1:{http_port}")
