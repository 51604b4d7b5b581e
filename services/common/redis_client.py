"""The one way every role opens its asyncio Redis client, and how it rides out a Redis outage.

- No socket timeout: redis-py 8's default (5 s) wraps each write in ``asyncio.wait_for``,
  which on Python 3.11 can swallow task cancellation and hang a shutdown; keepalive and
  periodic health checks detect dead links instead. Connecting does time out
  (``CONNECT_TIMEOUT_S``), so an unreachable host fails like a refused port.
- A blocking pool: a burst of concurrent calls waits for a free connection rather than
  failing with "Too many connections".
- ``OutageRetry``: a command that hits a connection error (server restarting, link dropped,
  still loading its AOF) reconnects and is sent again, with exponential backoff, for up to
  ``OUTAGE_BUDGET_S``. So a Redis restart of a few seconds is a pause, not an error, for every
  caller in every role (router, replicas, reward, refcritic, their worker loops). Only after
  the budget does the ``ConnectionError`` reach the caller (a gRPC handler then answers
  UNAVAILABLE, which clients retry; worker loops log it and keep going).
- Refusals are not outages: a wrong or missing password (``AuthenticationError``, which
  redis-py counts as a connection error) fails at once, with what to check, instead of being
  retried for the whole budget.
- TLS: a ``rediss://`` URL trusts the process's ``tls.ca_file`` and presents its
  ``tls.cert_file`` (``tls.redis_options``), so a Redis that requires client certificates
  (``tls-auth-clients yes``) takes the fleet's roles and nobody else.
- ``stop_retrying()``: once the process is shutting down (SIGTERM/SIGINT) nobody waits for
  Redis any more: every call fails at once, so a role whose Redis has vanished still exits
  promptly. Work it held stays pending in its stream and is reclaimed by another worker.

What a retry can cost: a command whose reply was lost with the connection may run twice
(an ``XADD`` queues a duplicate entry, which is answered once because answers are ``SET NX``;
an ``INCR`` is counted twice until counts are reconciled). Nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError

from rlfleet.common import tls

log = logging.getLogger(__name__)
T = TypeVar("T")

OUTAGE_BUDGET_S = 30.0
"""How long one command keeps retrying a lost server before its error reaches the caller."""
CONNECT_TIMEOUT_S = 2.0
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, 1.0
"""Retries at 0.1, 0.2, 0.4, 0.8, then every 1 s: back within ~1 s of the server."""

_stopping = False  # module-wide: each connection deep-copies its Retry, so no per-object flag


def stop_retrying() -> None:
    """From now on, no Redis call of this process waits for an outage to end (shutdown)."""
    global _stopping
    _stopping = True


def retrying() -> bool:
    return not _stopping


class OutageRetry(Retry):
    """redis-py's ``Retry`` bounded by time (``budget_s``) instead of a count, and cut short
    by ``stop_retrying``. Retries only connection and timeout errors (redis-py's default)."""

    def __init__(self, budget_s: float = OUTAGE_BUDGET_S) -> None:
        super().__init__(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), 10**6)
        self.budget_s = budget_s

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, OutageRetry) and other.budget_s == self.budget_s

    __hash__ = Retry.__hash__

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        deadline, failures = time.monotonic() + self.budget_s, 0
        while True:
            try:
                return await do()
            except self._supported_errors as error:
                if isinstance(error, Refused):  # said already, one call further in
                    raise
                if is_refusal(error):
                    raise refused(error) from error
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                await (fail(error, failures) if with_failure_count else fail(error))
                pause = self._backoff.compute(failures)
                if _stopping or time.monotonic() + pause > deadline:
                    raise
                _log_failure(error, failures)
                await asyncio.sleep(pause)


def _log_failure(error: Exception, failures: int) -> None:
    """One WARNING when an outage starts and one every ~10 retries, not one per attempt."""
    if failures == 1 or failures % 10 == 0:
        hint, own = "", tls.current()
        if "reset by peer" in str(error) and own.dialing and not own.serving:
            hint = " (a Redis with TLS client certificates resets clients without tls.cert_file)"
        log.warning("Redis unreachable (%s)%s; retry %d, still trying", error, hint, failures)


class Refused:
    """Marks an error ``refused`` has explained: a setting to fix, not an outage."""


class WrongPassword(Refused, AuthenticationError):
    pass


class TlsRefused(Refused, RedisConnectionError):
    pass


CERTIFICATE_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
}
"""What a Redis with ``tls-auth-clients yes`` answers a client without a certificate from its
CA (when its alert arrives before it closes the connection: else the client sees a reset)."""


def is_refusal(error: Exception) -> bool:
    """A wrong or missing password, a server certificate this process does not trust, or its
    own certificate refused: a setting to fix, which no retry cures."""
    cause = error.__context__
    refused_cert = isinstance(cause, ssl.SSLError) and cause.reason in CERTIFICATE_ALERTS
    untrusted = isinstance(cause, ssl.SSLCertVerificationError)
    return isinstance(error, AuthenticationError) or untrusted or refused_cert


def refused(error: Exception) -> RedisConnectionError:
    """``error`` saying which setting to check, for the log of the role it stops."""
    if isinstance(error, AuthenticationError):
        return WrongPassword(
            f"Redis refused this process's credentials ({error}): check redis_password "
            "(RLFLEET_REDIS_PASSWORD) or the password in redis_url (RLFLEET_REDIS_URL)"
        )
    if not isinstance(error.__context__, ssl.SSLCertVerificationError):
        return TlsRefused(
            f"Redis refused this process's certificate ({error}): check tls.cert_file and "
            "tls.key_file (a certificate signed by the CA Redis trusts, its tls-ca-cert-file)"
        )
    return TlsRefused(
        f"Redis's certificate is not trusted ({error}): check tls.ca_file (the CA that signed "
        "the Redis server's certificate) and that it names the host in redis_url"
    )


def connect(url: str, max_connections: int = 256, budget_s: float = OUTAGE_BUDGET_S) -> Redis:
    """The client every role uses; ``rediss://`` speaks TLS with the process's ``tls`` files."""
    pool = BlockingConnectionPool.from_url(
        url,
        **tls.redis_options(url),
        max_connections=max(4, max_connections),
        socket_timeout=None,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=30,
        retry=OutageRetry(budget_s),
    )
    return Redis.from_pool(pool)
