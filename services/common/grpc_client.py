"""Client-side gRPC helpers: channels with limits and retries, auth metadata, deadlines, and
the one map from a failed call's status code to the rlfleet exception it stands for.

Why one map: every role's client raises the same exception for the same status (the server
side maps exceptions to codes in ``grpc_server``), so callers catch ``InvalidArgument`` or
``Unavailable`` whichever service they called, and never import grpc themselves.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Self, TypeVar

import grpc

from rlfleet.common import call_counts, errors, tls
from rlfleet.common.config.security import TlsConfig
from rlfleet.common.grpc_server import message_options

T = TypeVar("T")
C = TypeVar("C", bound="ServiceClient")

ERROR_BY_STATUS: dict[grpc.StatusCode, type[errors.RlfleetError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
}
"""Any other code (INTERNAL, UNIMPLEMENTED, UNKNOWN, ...) becomes ``errors.Internal``."""

RETRY_SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{}],
            "retryPolicy": {
                "maxAttempts": 5,
                "initialBackoff": "0.1s",
                "maxBackoff": "2s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


def _counted(continuation, details, request):
    method = details.method
    call_counts.record(method.decode() if isinstance(method, bytes) else method)
    return continuation(details, request)


# grpc.aio files each interceptor under ONE call shape (the first base class it matches), so
# each shape takes its own object. Client-streaming calls are not intercepted: an intercepted
# stream whose server rejects it mid-way reports INTERNAL instead of the server's status, so
# their callers count them (``call_counts.record``; the weight push does).
class _CountUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await _counted(continuation, details, request)


class _CountUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await _counted(continuation, details, request)


def _call_counters() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that count every outgoing call by method (``call_counts``)."""
    return [_CountUnaryUnary(), _CountUnaryStream()]


def make_channel(
    address: str, max_message_mb: int = 64, retry: bool = True, tls_config: TlsConfig | None = None
) -> grpc.aio.Channel:
    """An aio channel that retries UNAVAILABLE and counts its calls (``call_counts``); TLS
    when this process's ``tls`` config (or ``tls_config``) says so, plaintext otherwise.

    ``address`` may list several servers, comma-separated (``h1:50051,h2:50051``, e.g.
    routers sharing one Redis): gRPC then keeps a connection to each and spreads calls over
    those that are up (``round_robin``); a call that fails because its server died is retried
    on another (the retry policy), so callers go on while any of them is up. With TLS every
    server's certificate must then hold the first address's host (or ``tls.server_name``)."""
    options = [
        *message_options(max_message_mb),
        ("grpc.enable_retries", int(retry)),
        *tls.channel_options(tls_config),
    ]
    target, several = channel_target(address)
    config: dict = {"loadBalancingConfig": [{"round_robin": {}}]} if several else {}
    if several:  # the name TLS checks in every server's certificate (unless tls.server_name)
        options.append(("grpc.default_authority", address.split(",")[0].strip()))
    if retry:
        config |= RETRY_SERVICE_CONFIG
    if config:
        options.append(("grpc.service_config", json.dumps(config)))
    credentials = tls.channel_credentials(tls_config)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=_call_counters())
    return grpc.aio.secure_channel(
        target, credentials, options=options, interceptors=_call_counters()
    )


def channel_target(address: str) -> tuple[str, bool]:
    """The gRPC target for ``address``, and whether it names several servers. One
    ``host:port`` is kept as it is; several become one ``ipv4:``/``ipv6:`` target (gRPC's own
    multi-address form), their host names resolved now."""
    parts = [p.strip() for p in address.split(",") if p.strip()]
    if len(parts) == 1:
        return parts[0], False
    if not parts:
        raise ValueError(f"no server address in {address!r}")
    resolved = [_resolve(host, port) for host, port in [_host_port(part) for part in parts]]
    families = {family for family, _ in resolved}
    if len(families) > 1:
        raise ValueError(f"{address!r} mixes IPv4 and IPv6 servers; gRPC needs one family")
    return f"{families.pop()}:" + ",".join(where for _, where in resolved), True


def _host_port(address: str) -> tuple[str, str]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"server address {address!r} is not host:port")
    return host.strip("[]"), port


def _resolve(host: str, port: str) -> tuple[str, str]:
    """``("ipv4", "10.0.0.1:50051")`` or ``("ipv6", "[::1]:50051")``; a name is resolved."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            info = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"cannot resolve server host {host!r}: {exc}") from exc
        ip = ipaddress.ip_address(info[0][4][0])
    return (f"ipv{ip.version}", f"{ip}:{port}" if ip.version == 4 else f"[{ip}]:{port}")


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata to send with every call when the fleet has an API key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


async def wait_ready(channel: grpc.aio.Channel, timeout_s: float) -> None:
    """Wait until the channel connects, or raise TimeoutError naming the target."""
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"gRPC server not reachable within {timeout_s:.0f}s") from exc


def error_from_rpc(exc: grpc.aio.AioRpcError, service: str = "") -> errors.RlfleetError:
    """The rlfleet exception a failed call stands for; raise it ``from exc`` to keep the code."""
    error_type = ERROR_BY_STATUS.get(exc.code(), errors.Internal)
    prefix, details = f"{service} " if service else "", exc.details() or ""
    return error_type(f"{prefix}{exc.code().name}: {details}{tls.refusal_hint(details)}")


async def checked(call: Awaitable[T], service: str = "") -> T:
    """Await a call, turning a gRPC status into the matching rlfleet exception."""
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        raise error_from_rpc(exc, service) from exc


class ServiceClient:
    """One channel to one role's service: its API key on every call, a deadline of
    ``timeout_s`` (None: none), and rlfleet exceptions named after ``SERVICE`` instead of gRPC
    errors. ``async with Client(address) as client`` closes the channel; so does ``close()``."""

    SERVICE = ""
    """The service's name in the errors its calls raise (``"reward INVALID_ARGUMENT: ..."``)."""

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        timeout_s: float | None = None,
        max_message_mb: int = 64,
    ) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = make_channel(address, max_message_mb)
        self._metadata = auth_metadata(api_key)

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        await wait_ready(self._channel, timeout_s)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Awaitable[T]], message: Any) -> T:
        call = method(message, metadata=self._metadata, timeout=self.timeout_s)
        return await checked(call, self.SERVICE)


class SyncServiceClient(Generic[C]):
    """A blocking wrapper over an async client, with an event loop of its own, for scripts and
    notebooks that have none (not for use inside a running loop)."""

    def __init__(self, make: Callable[[], C]) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = self._run(_built(make))

    def _run(self, call: Awaitable[T]) -> T:
        return self._loop.run_until_complete(call)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        self._run(self._client.wait_ready(timeout_s))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._client.close())
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _built(make: Callable[[], C]) -> C:
    """The async client made inside the wrapper's loop (a channel binds to the loop it is
    made in)."""
    return make()
