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


def start_http_router(
    redis_url: str, keys: Keys, log_path: Path, *extra: str, model: Path = MODEL
) -> RouterProc:
    port, http_port = free_port(), free_port()
    command = [
        sys.executable,
        "-m",
        "rlfleet.rollout.router.main",
        "--port",
        str(port),
        f"redis_url={redis_url}",
        f"cluster={keys.cluster}",
        f"model.path={model}",
        f"router.http_port={http_port}",
        "router.janitor_interval_s=0.3",
        *extra,
    ]
    proc = start_and_wait(command, log_path, lambda p: p.wait_for_line("router ready", 60))
    return RouterProc(proc, f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}")
