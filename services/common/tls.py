"""TLS credentials for gRPC servers and channels and for the HTTP fronts, from ``TlsConfig``.

Why a process-wide default: every role opens servers and clients in many places (a role's own
server, its clients of other roles, the trainer's direct channels to replicas). Each role's
entry point sets the default once from its config (``use``, called by ``entry.resolve``), and
every ``GrpcServer``, ``make_channel`` and ``make_http_server`` reads it unless handed a config
of its own. With no certificate configured nothing changes: plaintext, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

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


def server_credentials(config: TlsConfig | None = None) -> grpc.ServerCredentials | None:
    """Credentials for ``add_secure_port``; None when this process serves plaintext."""
    config = config if config is not None else _default
    if not config.serving:
        return None
    import grpc

    pair = (_read(config.key_file), _read(config.cert_file))
    return grpc.ssl_server_credentials([pair])


def channel_credentials(config: TlsConfig | None = None) -> grpc.ChannelCredentials | None:
    """Credentials for ``secure_channel``; None when clients of this process dial plaintext."""
    import grpc

    config = config if config is not None else _default
    return grpc.ssl_channel_credentials(_read(config.ca_file)) if config.dialing else None


def channel_options(config: TlsConfig | None = None) -> list[tuple[str, str]]:
    """Channel options TLS needs: the name to check in the server's certificate, if set."""
    config = config if config is not None else _default
    if config.dialing and config.server_name:
        return [("grpc.ssl_target_name_override", config.server_name)]
    return []


def http_options(config: TlsConfig | None = None) -> dict[str, str]:
    """``uvicorn.Config`` keyword arguments that make an HTTP server speak TLS ({} = plain)."""
    config = config if config is not None else _default
    if not config.serving:
        return {}
    return {"ssl_certfile": str(config.cert_file), "ssl_keyfile": str(config.key_file)}
