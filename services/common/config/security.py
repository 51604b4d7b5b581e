"""Config of transport security: TLS for every gRPC and HTTP server and client of a process,
mutual TLS (client certificates) between the roles of a fleet, and TLS to Redis."""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from rlfleet.common.config.base import Section


class TlsConfig(Section):
    """TLS is off until a certificate is configured. One section serves both sides: a fleet
    sharing one config file gets TLS servers and clients that trust them. ``rlfleet certs DIR``
    makes a CA and a certificate per role for a dev fleet (docs/deployment.md, "Encryption and
    identity between hosts")."""

    cert_file: str | None = None
    """PEM certificate (chain) every gRPC and HTTP server of this process presents; with
    ``key_file`` it turns TLS on for them (plaintext connections are then refused), and clients
    of this process connect with TLS too. Clients present it to servers that ask for a client
    certificate (``client_auth``), and so to a Redis that does (``rediss://``): a role has one
    identity, as server and as client."""
    key_file: str | None = None
    """PEM private key of ``cert_file``."""
    ca_file: str | None = None
    """PEM bundle of the CAs clients trust for servers' certificates (a self-signed
    certificate is its own CA), and with ``client_auth`` the CAs whose client certificates
    servers accept (the fleet's CA). Set alone (a client-only process) it makes clients connect
    with TLS; None with ``cert_file`` set: the system's trusted roots."""
    server_name: str | None = None
    """Name clients check in the servers' certificates when it differs from the host they
    dial (one certificate for a fleet reached by IP address); None = the dialled host."""
    client_auth: bool = False
    """Mutual TLS: every gRPC and HTTP server of this process requires a client certificate
    signed by a CA in ``ca_file`` and refuses a client without one (or with one from another
    CA) during the handshake. Needs ``cert_file``, ``key_file`` and ``ca_file``: the process's
    own clients present ``cert_file`` in turn, so give every role of the fleet this setting
    and a certificate from the same CA."""

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
        if self.client_auth and not (self.cert_file and self.ca_file):
            raise ValueError(
                "tls.client_auth needs tls.ca_file (the CA that signs the clients' certificates) "
                "and tls.cert_file/tls.key_file (this process's own certificate, presented as "
                "server and as client); `rlfleet certs DIR` makes all three for a dev fleet"
            )
        return self
