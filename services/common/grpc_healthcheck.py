"""Exit 0 when a gRPC server answers SERVING on ``grpc.health.v1.Health``; 1 otherwise.

Why: container health checks (docker compose ``healthcheck``, Kubernetes exec probes) only
look at an exit status. The image already ships grpcio and grpcio-health-checking, so a few
lines of Python replace a separate ``grpc_health_probe`` binary. It imports nothing heavy
(no torch), so a probe costs a fraction of a second.

Usage: ``python -m rlfleet.common.grpc_healthcheck HOST:PORT [--service NAME] [--timeout S]
[--ca-file PEM [--cert-file PEM --key-file PEM]]`` (``--ca-file``: the server speaks TLS with a
certificate from that CA; ``--cert-file``/``--key-file``: the probe's own certificate, for a
server that requires one, ``tls.client_auth``).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.common import tls
from rlfleet.common.config.security import TlsConfig


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """Ask ``address`` for the health of ``service`` ("" = the whole server).

    Returns (serving, what was seen) so the caller can say why a probe failed. TLS when this
    process's ``tls`` config dials TLS.
    """
    credentials, options = tls.channel_credentials(), tls.channel_options()
    channel = (
        grpc.secure_channel(address, credentials, options)
        if credentials
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            reply = stub.Check(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet.common.grpc_healthcheck", description=__doc__.splitlines()[0]
    )
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help='service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for a reply")
    parser.add_argument("--ca-file", help="PEM CA bundle: connect with TLS, trusting it")
    parser.add_argument("--cert-file", help="PEM certificate to present (mutual TLS)")
    parser.add_argument("--key-file", help="PEM private key of --cert-file")
    args = parser.parse_args(argv)
    if args.ca_file or args.cert_file:
        files = {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}
        try:
            tls.use(TlsConfig(**files))
        except ValueError as exc:  # a missing file, a certificate without its key
            parser.error(str(exc))
    serving, seen = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {seen}", file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
