"""TLS for gRPC and HTTP with a real certificate (self-signed, made by ``openssl`` here): a
TLS server answers a client that trusts its CA, over one address or several; a plaintext
client is refused; the HTTP front serves HTTPS. Servers run in this process on loopback."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path

import grpc
import httpx
import pytest
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.common.config.security import TlsConfig
from rlfleet.common.grpc_client import make_channel
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.http_server import make_http_server
from rlfleet.common.redis_server import free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
NEW_KEY = (
    "openssl",
    "req",
    "-x509",
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
)


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    """A self-signed certificate for localhost / 127.0.0.1 (its own CA)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *NEW_KEY,
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return TlsConfig(cert_file=str(cert), key_file=str(key), ca_file=str(cert))


async def health(address: str, tls_config: TlsConfig) -> int:
    channel = make_channel(address, retry=False, tls_config=tls_config)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status
    finally:
        await channel.close()


async def test_grpc_over_tls_and_plaintext_refused(cert: TlsConfig) -> None:
    server = GrpcServer([], "127.0.0.1", 0, tls_config=cert)
    port = await server.start()
    try:
        address = f"127.0.0.1:{port}"
        client = TlsConfig(ca_file=cert.ca_file)  # a client-only process: trusts the CA
        assert await health(address, client) == health_pb2.HealthCheckResponse.SERVING
        dead = f"127.0.0.1:{free_port()}"  # several addresses, one down: still TLS, still up
        assert await health(f"{dead},{address}", client) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await health(address, TlsConfig())
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_untrusted_certificate_is_refused(cert: TlsConfig, tmp_path: Path) -> None:
    other = tmp_path / "other.pem"
    subprocess.run(
        [
            *NEW_KEY,
            "-days",
            "2",
            "-subj",
            "/CN=other",
            "-keyout",
            str(tmp_path / "k.pem"),
            "-out",
            str(other),
        ],
        check=True,
        capture_output=True,
    )
    server = GrpcServer([], "127.0.0.1", 0, tls_config=cert)
    port = await server.start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health(f"127.0.0.1:{port}", TlsConfig(ca_file=str(other)))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_http_front_serves_https(cert: TlsConfig) -> None:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, str]:
        return {"pong": "yes"}

    port = free_port()
    server = make_http_server(app, "127.0.0.1", port, tls_config=cert)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=cert.ca_file), timeout=5
        ) as client:
            reply = await client.get(f"https://127.0.0.1:{port}/ping")
            assert reply.json() == {"pong": "yes"}
            with pytest.raises(httpx.HTTPError):
                await client.get(f"http://127.0.0.1:{port}/ping")
    finally:
        server.should_exit = True
        await task
