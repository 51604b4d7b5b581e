"""Config of transport security: TLS for every gRPC and HTTP server and client of a process."""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from rlfleet.common.config.base import Section


class TlsConfig(Section):
    """TLS is off until a certificate is configured. One section serves both sides: a fleet
    sharing one config file gets TLS servers and clients that trust them."""

    cert_file: str | None = None
    """PEM certificate (chain) every gRPC and HTTP server of this process presents; with
    ``key_file`` it turns TLS on for them (plaintext connections are then refused), and clients
    of this process connect with TLS too."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    ca_file: str | None = None
    """PEM bundle of the CAs clients trust for servers' certificates (a self-signed
    certificate is its own CA). Set alone (a client-only process, e.g. the trainer) it makes
    clients connect with TLS; None with ``cert_file`` set: the system's trusted roots."""
    server_name: str | None = None
    """Name clients check in the servers' certificates when it differs from the host they
    dial (one certificate for a fleet reached by IP address); None = the dialled host."""

    @property
    def serving(self) -> bool:
        """Servers speak TLS."""
        return bool(self.cert_file and self.key_file)

    @property
    def dialing(self) -> bool:
        """Clients speak TLS."""
        return bool(self.ca_file or self.cert_file)

    @model_validator(mode="after")
    def _check_files(self) -> TlsConfig:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls.cert_file and tls.key_file must be set together")
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"tls.{name}: no such file: {path}")
        return self
