"""The container health probe against a real rlfleet gRPC server.

docker-compose.yml gates every role on ``python -m rlfleet.common.grpc_healthcheck``; a probe
that said "healthy" too early would let the trainer start against a replica still loading its
model, and one that never said it would hold the fleet forever. So the probe is run the way
Docker runs it (a child process, judged by exit status) against the server helper every role
uses.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

from rlfleet.common.grpc_server import GrpcServer


async def probe(address: str, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "rlfleet.common.grpc_healthcheck", address, *extra]
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30)


async def test_probe_follows_serving_state():
    server = GrpcServer([], "127.0.0.1", 0)
    port = await server.start()
    address = f"127.0.0.1:{port}"
    try:
        serving = await probe(address)
        assert serving.returncode == 0, serving.stderr
        assert "SERVING" in serving.stdout

        await server.set_serving(False)
        loading = await probe(address)
        assert loading.returncode == 1
        assert "NOT_SERVING" in loading.stderr
    finally:
        await server.stop(0)


async def test_probe_fails_fast_when_nothing_listens():
    server = GrpcServer([], "127.0.0.1", 0)
    port = await server.start()
    await server.stop(0)
    result = await probe(f"127.0.0.1:{port}", "--timeout", "2")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr
