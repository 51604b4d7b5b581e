"""One way to run a gRPC aio server for every role.

Each server gets: the health service (``grpc.health.v1.Health``) and reflection, explicit
message-size limits, an interceptor that turns exceptions into proper status codes (never
a bare UNKNOWN; a request that does not even parse, e.g. a string field that is not UTF-8,
is INVALID_ARGUMENT naming the field: ``proto_decode``) and checks the API key when one is
configured (compared in constant time), TLS when a certificate is configured (``tls``), and
graceful shutdown.
"""

from __future__ import annotations

import asyncio
import faulthandler
import hmac
import inspect
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlfleet.common import errors, tls
from rlfleet.common.config.security import TlsConfig
from rlfleet.common.proto_decode import check, checked_stream, tolerant

log = logging.getLogger(__name__)

STATUS_BY_EXCEPTION: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (NotImplementedError, grpc.StatusCode.UNIMPLEMENTED),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ConnectionError, grpc.StatusCode.UNAVAILABLE),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
]
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code an exception maps to; unexpected errors are INTERNAL."""
    try:
        import redis.exceptions as redis_errors

        if isinstance(exc, redis_errors.ConnectionError | redis_errors.TimeoutError):
            return grpc.StatusCode.UNAVAILABLE
    except ImportError:  # pragma: no cover - redis is a hard dependency
        pass
    for exc_type, code in STATUS_BY_EXCEPTION:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_for(exc)
    level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.WARNING
    log.log(level, "%s failed with %s: %s", method, code.name, exc, exc_info=level == logging.ERROR)
    await context.abort(code, f"{type(exc).__name__}: {exc}"[:2000])


def _check_auth(context: grpc.aio.ServicerContext, api_key: str | None, method: str) -> None:
    if not api_key or method.startswith(OPEN_METHOD_PREFIXES):
        return
    metadata = dict(context.invocation_metadata() or ())
    given = str(metadata.get("authorization", "")).encode()
    if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):  # constant time
        raise errors.Unauthenticated("missing or wrong API key (authorization: Bearer <key>)")


def _parsed(request_or_iterator: Any, streaming: bool) -> Any:
    """The request (InvalidArgument if it did not parse), or a stream that checks each one."""
    return checked_stream(request_or_iterator) if streaming else check(request_or_iterator)


def _wrap_unary(
    behavior: Callable, method: str, api_key: str | None, streaming: bool = False
) -> Callable:
    async def wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_auth(context, api_key, method)
            return await behavior(_parsed(request_or_iterator, streaming), context)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status code
            await _abort_with(context, exc, method)

    return wrapper


def _wrap_stream(
    behavior: Callable, method: str, api_key: str | None, streaming: bool = False
) -> Callable:
    if not inspect.isasyncgenfunction(behavior):
        # A handler that streams with ``context.write`` (grpc's health Watch) is a coroutine;
        # grpc forbids mixing that style with yielding, so it is wrapped as one.
        return _wrap_unary(behavior, method, api_key, streaming)

    async def wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_auth(context, api_key, method)
            async for item in behavior(_parsed(request_or_iterator, streaming), context):
                yield item
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort_with(context, exc, method)

    return wrapper


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes and enforces the optional API key."""

    def __init__(self, api_key: str | None = None) -> None:
        self._api_key = api_key

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[override]
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        key = self._api_key
        parse = tolerant(handler.request_deserializer)
        if handler.unary_unary:
            fn = _wrap_unary(handler.unary_unary, method, key)
            return grpc.unary_unary_rpc_method_handler(fn, parse, handler.response_serializer)
        if handler.stream_unary:
            fn = _wrap_unary(handler.stream_unary, method, key, streaming=True)
            return grpc.stream_unary_rpc_method_handler(fn, parse, handler.response_serializer)
        if handler.unary_stream:
            fn = _wrap_stream(handler.unary_stream, method, key)
            return grpc.unary_stream_rpc_method_handler(fn, parse, handler.response_serializer)
        fn = _wrap_stream(handler.stream_stream, method, key, streaming=True)
        return grpc.stream_stream_rpc_method_handler(fn, parse, handler.response_serializer)


def message_options(max_message_mb: int) -> list[tuple[str, int]]:
    limit = max_message_mb * 1024 * 1024
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]


@dataclass
class Registration:
    """A servicer plus the generated ``add_XServicer_to_server`` and its full service name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    service_name: str


class GrpcServer:
    """A started aio server with health + reflection; ``port`` is the bound port."""

    def __init__(
        self,
        registrations: Iterable[Registration],
        host: str,
        port: int,
        max_message_mb: int = 64,
        api_key: str | None = None,
        tls_config: TlsConfig | None = None,
    ) -> None:
        self._registrations = list(registrations)
        self._credentials = tls.server_credentials(tls_config)  # None: plaintext
        self._address = f"{host}:{port}"
        self._server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor(api_key)],
            options=message_options(max_message_mb),
        )
        self._health = health.aio.HealthServicer()
        self.port = 0

    async def start(self) -> int:
        for reg in self._registrations:
            reg.add_to_server(reg.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = [reg.service_name for reg in self._registrations]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self._server)
        if self._credentials is None:
            self.port = self._server.add_insecure_port(self._address)
        else:
            self.port = self._server.add_secure_port(self._address, self._credentials)
        if self.port == 0:
            raise OSError(f"could not bind gRPC server to {self._address}")
        await self._server.start()
        await self.set_serving(True)
        log.info(
            "gRPC %s listening on port %d%s",
            ", ".join(names),
            self.port,
            " (TLS)" if self._credentials else "",
        )
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set("", status)
        for reg in self._registrations:
            await self._health.set(reg.service_name, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        await self._server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


STOP_DEADLINE_S = 20.0
"""How long a role may take to stop after SIGTERM/SIGINT before it dumps every thread's stack
and exits: a stop that waits on something that cannot be cancelled (a model load in a worker
thread, which ``asyncio.run`` joins at exit) must not outlive the launcher that asked for it.
Above the launchers' 10 s grace on purpose: a role they stop is SIGKILLed first."""


def install_stop_signals(stop_event: asyncio.Event) -> None:
    """SIGTERM/SIGINT set ``stop_event`` so the role can shut down gracefully."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop_requested, stop_event)


def _stop_requested(stop_event: asyncio.Event) -> None:
    """Shutting down: Redis calls stop riding out outages (``redis_client``), so a role whose
    Redis is gone still exits promptly."""
    from rlfleet.common.redis_client import stop_retrying

    stop_retrying()
    if not stop_event.is_set():  # a second signal must not push the deadline back
        faulthandler.dump_traceback_later(STOP_DEADLINE_S, exit=True)
    stop_event.set()
