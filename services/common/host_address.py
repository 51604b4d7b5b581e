"""Whether a peer's address is this host's own: decided by the address, never by hostnames.

Why: the trainer hands replicas on its own host a shared-memory file instead of streaming the
weight bytes (``rlfleet.model.weights_shm``). "Its own host" cannot be read off hostnames or
off ``/dev/shm`` being readable: network namespaces (and some container setups) share the
machine's hostname and ``/dev/shm`` while having addresses of their own, and a fleet spread over
them must behave as across machines, streaming the bytes. So a peer is on this host when its
address is one this process could bind itself: loopback, or an address assigned to an interface
of this process's network namespace. The check binds a UDP socket to the address on port 0 (no
packet is sent; the kernel refuses an address that is not ours with EADDRNOTAVAIL).

A name other than ``localhost`` is not looked up (no DNS on the hot path): ``on_this_host``
answers None (unknown), and the caller falls back to asking the peer (a replica that cannot
open the file answers NOT_FOUND).
"""

from __future__ import annotations

import ipaddress
import socket

LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def split_host(address: str) -> str:
    """``host:port`` -> host (``[::1]:50051`` -> ``::1``; a bare host is returned as is)."""
    if address.startswith("["):
        return address[1 : address.index("]")]
    if address.count(":") == 1:
        return address.rsplit(":", 1)[0]
    return address  # a bare name, or an IPv6 literal without a port


def is_own_ip(ip: str) -> bool:
    """Whether ``ip`` (a literal address) belongs to this network namespace: bindable here."""
    parsed = ipaddress.ip_address(ip)
    if parsed.is_loopback or parsed.is_unspecified:
        return True
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def on_this_host(address: str) -> bool | None:
    """True when ``address`` (``host:port``) is this host's (loopback or one of this
    namespace's addresses), False when it is a literal address of another host, None when the
    host is a name (not looked up) or a ``unix:`` socket path's peer is unknown."""
    if address.startswith("unix:"):
        return True  # a Unix socket is always on this machine's filesystem
    host = split_host(address)
    if host.lower() in LOCAL_NAMES:
        return True
    try:
        return is_own_ip(host)
    except ValueError:  # a name, not an address
        return None
