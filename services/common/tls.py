"""TLS credentials for gRPC servers and channels, the HTTP fronts and clients, and Redis, from
``TlsConfig``.

Why a process-wide default: every role opens servers and clients in many places (a role's own
server, its clients of other roles, the trainer's direct channels to replicas). Each role's
entry point sets the default once from its config (``use``, called by ``entry.resolve``), and
every ``GrpcServer``, ``make_channel``, ``make_http_server`` and Redis ``connect`` reads it
unless handed a config of its own. With no certificate configured nothing changes: plaintext,
as before.

Mutual TLS (``tls.client_auth``): servers ask for a client certificate and check it against
``ca_file`` in the handshake, so a client without one never reaches a handler (gRPC answers
UNAVAILABLE, an HTTP client sees its connection reset). Clients present ``cert_file`` whenever
one is set: a server that does not ask simply ignores it.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.common.config.security import TlsConfig

if TYPE_CHECKING:  # grpc is imported when credentials are made: entry points stay light
    import grpc

_default = TlsConfig()


def use(config: TlsConfig) -> None:
    """Make ``config`` this process's TLS setting (servers and clients)."""
    global _default
    _default = config


def current() -> TlsConfig:
    return _default


def _read(path: str | None) -> bytes | None:
    return Path(path).expanduser().read_bytes() if path else None


def _path(path: str | None) -> str | None:
    return str(Path(path).expanduser()) if path else None


def _pair(config: TlsConfig) -> tuple[str, str]:
    """The certificate and key of a config that ``serving``."""
    if not (config.cert_file and config.key_file):
        raise ValueError("no tls.cert_file and tls.key_file")
    return str(Path(config.cert_file).expanduser()), str(Path(config.key_file).expanduser())


def scheme(config: TlsConfig | None = None) -> str:
    """``https`` when this process's HTTP servers speak TLS, else ``http`` (for the URLs that
    roles print and write to ``endpoints.json``)."""
    config = config if config is not None else _default
    return "https" if config.serving else "http"


def server_credentials(config: TlsConfig | None = None) -> grpc.ServerCredentials | None:
    """Credentials for ``add_secure_port``; None when this process serves plaintext. With
    ``client_auth`` a client must present a certificate from ``ca_file``."""
    config = config if config is not None else _default
    if not config.serving:
        return None
    import grpc

    pair = (_read(config.key_file), _read(config.cert_file))
    if not config.client_auth:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials(
        [pair], root_certificates=_read(config.ca_file), require_client_auth=True
    )


def channel_credentials(config: TlsConfig | None = None) -> grpc.ChannelCredentials | None:
    """Credentials for ``secure_channel`` (presenting this process's certificate when it has
    one); None when clients of this process dial plaintext."""
    import grpc

    config = config if config is not None else _default
    if not config.dialing:
        return None
    return grpc.ssl_channel_credentials(
        _read(config.ca_file),
        private_key=_read(config.key_file) if config.serving else None,
        certificate_chain=_read(config.cert_file) if config.serving else None,
    )


def refusal_hint(details: str, config: TlsConfig | None = None) -> str:
    """What to check when a TLS connection closed in its handshake ("" for other failures):
    a server with ``client_auth`` hangs up on a client without a certificate from its CA, and
    the client only sees the socket close."""
    config = config if config is not None else _default
    text = details.lower()
    if not config.dialing or not any(s in text for s in ("socket closed", "handshake", "ssl")):
        return ""
    if not config.serving:
        return (
            " (if the server refused the TLS handshake: a server with tls.client_auth needs a "
            "client certificate, tls.cert_file and tls.key_file, signed by the fleet's CA)"
        )
    return (
        " (if the server refused the TLS handshake: check that the CA the server trusts "
        "signed tls.cert_file, and that tls.ca_file signed the server's certificate)"
    )


def channel_options(config: TlsConfig | None = None) -> list[tuple[str, str]]:
    """Channel options TLS needs: the name to check in the server's certificate, if set."""
    config = config if config is not None else _default
    if config.dialing and config.server_name:
        return [("grpc.ssl_target_name_override", config.server_name)]
    return []


def http_options(config: TlsConfig | None = None) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that make an HTTP server speak TLS ({} = plain),
    requiring a client certificate from ``ca_file`` with ``client_auth``."""
    config = config if config is not None else _default
    if not config.serving:
        return {}
    options: dict[str, Any] = {"ssl_certfile": _path(config.cert_file)}
    options["ssl_keyfile"] = _path(config.key_file)
    if config.client_auth:
        options |= {"ssl_ca_certs": _path(config.ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


def server_ssl_context(config: TlsConfig | None = None) -> ssl.SSLContext | None:
    """An ``SSLContext`` for a plain socket server (a replica's ``/metrics``), the same rules
    as ``http_options``; None when this process serves plaintext."""
    config = config if config is not None else _default
    if not config.serving:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*_pair(config))
    if config.client_auth:
        context.load_verify_locations(_path(config.ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(
    config: TlsConfig | None = None, system_roots: bool = False
) -> ssl.SSLContext | None:
    """An ``SSLContext`` for HTTP clients (``httpx``'s ``verify=``) that trusts ``ca_file``
    (and the system's roots with ``system_roots``, for a URL that may lie outside the fleet,
    or when no ``ca_file`` is set) and presents this process's certificate; None when clients
    of this process do not dial TLS (the library's own default then applies)."""
    config = config if config is not None else _default
    if not config.dialing:
        return None
    context = ssl.create_default_context(cafile=_path(config.ca_file))
    if system_roots and config.ca_file:
        context.load_default_certs()
    if config.serving:
        context.load_cert_chain(*_pair(config))
    return context


def redis_options(url: str, config: TlsConfig | None = None) -> dict[str, str]:
    """redis-py keyword arguments for a ``rediss://`` URL: trust ``ca_file`` and present this
    process's certificate (the fleet's CA signs the Redis server's certificate too); {} for
    ``redis://``. A URL's own ``ssl_*`` query parameters win over these."""
    config = config if config is not None else _default
    if not url.startswith("rediss://"):
        return {}
    options = {"ssl_ca_certs": _path(config.ca_file)}
    if config.serving:
        options |= {"ssl_certfile": _path(config.cert_file), "ssl_keyfile": _path(config.key_file)}
    return {name: value for name, value in options.items() if value}
