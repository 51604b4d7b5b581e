"""``rlfleet certs DIR``: a CA and a certificate per role for a dev fleet's mutual TLS
(``rlfleet.launch.pki`` makes them; ``cryptography`` is imported after parsing, so ``--help``
is instant), then how to point a config at them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_DAYS = 365
ROLES = (
    "trainer",
    "rollout",
    "router",
    "reward",
    "refcritic",
    "env",
    "dashboard",
    "redis",
    "client",
    "fleet",
)
"""The certificates made by default: one per role, ``redis`` for a Redis server with TLS,
``client`` for tools and people (``rlfleet score``, ``curl``, the Tinker SDK), and ``fleet``
for a one-host fleet (``rlfleet up``) whose roles all read one config and so share one."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rlfleet certs",
        description="Make a CA (reused when DIR has one) and a certificate per role, each "
        "naming localhost, 127.0.0.1, ::1, its role and --hosts, for tls.* with client_auth.",
    )
    p.add_argument("dir", type=Path, help="where ca.pem, ca.key and ROLE.pem/ROLE.key go")
    p.add_argument(
        "--hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="more names and IP addresses every certificate holds (the hosts the fleet dials)",
    )
    p.add_argument(
        "--roles",
        nargs="+",
        default=list(ROLES),
        metavar="NAME",
        help=f"certificates to make (default: {' '.join(ROLES)})",
    )
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity (default 365)")
    p.add_argument("--force", action="store_true", help="replace certificates already in DIR")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from rlfleet.launch.pki import make_fleet

    try:
        issued, new_ca = make_fleet(args.dir, args.roles, args.hosts, args.days, args.force)
    except (OSError, ValueError) as exc:
        print(f"rlfleet certs: {exc}", file=sys.stderr)
        return 2
    print(how_to_use(args.dir, [i.name for i in issued], new_ca))
    return 0


def how_to_use(directory: Path, names: list[str], new_ca: bool) -> str:
    d = directory.resolve()
    ca = "a new CA" if new_ca else "the CA already there"
    example = next((n for n in names if n not in ("fleet", "client", "redis")), names[0])
    return f"""rlfleet certs: {ca} ({d}/ca.pem) and {len(names)} certificates: {", ".join(names)}
Keep ca.key off the fleet's hosts; give each host only its roles' ROLE.pem and ROLE.key.

Every role (config file; per role, override cert_file and key_file):
  tls:
    ca_file: {d}/ca.pem
    cert_file: {d}/ROLE.pem
    key_file: {d}/ROLE.key
    client_auth: true
e.g. rlfleet {example} --config CONFIG tls.cert_file={d}/{example}.pem tls.key_file={d}/{example}.key
One host (rlfleet up: every role reads one config): cert_file {d}/fleet.pem, key_file fleet.key.
Tools: rlfleet score/status with tls.cert_file={d}/client.pem tls.key_file={d}/client.key;
  curl --cacert {d}/ca.pem --cert {d}/client.pem --key {d}/client.key https://HOST:PORT/...

Redis with TLS, client certificates and a password (requirepass in its config file):
  redis-server CONF --port 0 --tls-port 6380 --tls-cert-file {d}/redis.pem \\
    --tls-key-file {d}/redis.key --tls-ca-cert-file {d}/ca.pem --tls-auth-clients yes
  RLFLEET_REDIS_URL=rediss://HOST:6380/0 RLFLEET_REDIS_PASSWORD=...  (roles present their
  tls.cert_file to it and trust tls.ca_file)"""
