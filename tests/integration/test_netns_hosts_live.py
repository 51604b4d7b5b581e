"""scripts/netns_hosts.py for real: two hosts (network namespaces on a bridge) reach each other
by their own addresses, also behind a FORWARD rule that drops the bridge's traffic (what Docker
leaves behind), and `down` leaves no namespace, veth, bridge, rule or process.

Needs root and a kernel that lets us make namespaces: skipped, saying why, where it cannot.
The DROP rule is the test's own (tagged, appended after `up`, deleted at the end); no rule of
the machine is read or changed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from script_modules import load_script

PREFIX = f"rlt{os.getpid() % 10000}"
DROP_TAG = f"rlfleet-test-drop:{PREFIX}"

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000))
s.listen()
print("listening", flush=True)
while True:
    c, peer = s.accept()
    c.sendall(c.recv(64)[::-1] + b" from " + peer[0].encode())
    c.close()
"""
CLIENT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))
    s.sendall(b"olleh")
    print(s.recv(64).decode())
except OSError as exc:
    print("failed:", exc)
"""


nh = load_script("netns_hosts")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def hosts(*args: str) -> subprocess.CompletedProcess:
    """The script's verb, unchecked: callers assert its return code with its stderr."""
    return sh(sys.executable, nh.__file__, *args, "--prefix", PREFIX, check=False)


def connect(host: str, address: str, timeout_s: float = 3.0) -> str:
    argv = ["ip", "netns", "exec", host, sys.executable, "-c", CLIENT, address, str(timeout_s)]
    return sh(*argv).stdout.strip()


def drop_rule(op: str) -> list[str]:
    spec = nh.forward_rule(PREFIX)[:-3]  # the bridge to itself, with our test's own tag
    return ["iptables", op, "FORWARD", *spec, DROP_TAG, "-j", "DROP"]


def leftovers() -> list[str]:
    found = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(f"{PREFIX}-")]
    found += [line for line in sh("ip", "-o", "link", "show").stdout.splitlines() if PREFIX in line]
    if shutil.which("iptables"):
        found += [r for r in sh("iptables", "-S", "FORWARD").stdout.splitlines() if PREFIX in r]
    return found


@pytest.fixture
def two_hosts():
    why = nh.cannot_make_namespaces()
    if why:
        pytest.skip(why)
    made = hosts("up", "--hosts", "2")
    assert made.returncode == 0, made.stderr
    drop = shutil.which("iptables") is not None
    try:
        if drop:  # a FORWARD rule that drops the bridge's traffic, after our ACCEPT
            sh(*drop_rule("-A"))
        yield made.stdout.split("\n")
    finally:
        down = hosts("down")
        if drop:
            sh(*drop_rule("-D"), check=False)
        assert down.returncode == 0, down.stderr


def test_two_hosts_reach_each_other_by_address_and_down_leaves_nothing(two_hosts):
    server = subprocess.Popen(
        ["ip", "netns", "exec", f"{PREFIX}-1", sys.executable, "-c", SERVER, "198.51.100.11"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout.readline().strip() == "listening"
        # host 0 reaches host 1 by its address; host 1 sees host 0's own address
        assert connect(f"{PREFIX}-0", "198.51.100.11") == "hello from 198.51.100.10"
        # 127.0.0.1 in host 0 is host 0's own loopback: host 1's server is not there
        assert connect(f"{PREFIX}-0", "127.0.0.1", 1.0).startswith("failed")
        if shutil.which("iptables"):
            # without our ACCEPT rule, the test's DROP rule cuts the hosts apart
            accept = nh.forward_rule(PREFIX)
            sh("iptables", "-D", "FORWARD", *accept)
            assert connect(f"{PREFIX}-0", "198.51.100.11", 1.0).startswith("failed")
            sh("iptables", "-I", "FORWARD", *accept)
            assert connect(f"{PREFIX}-0", "198.51.100.11") == "hello from 198.51.100.10"
        # a cut link (the bridge side of host 1's veth down) and back
        cut = hosts("link", f"{PREFIX}-1", "down")
        assert cut.returncode == 0, cut.stderr
        assert connect(f"{PREFIX}-0", "198.51.100.11", 1.0).startswith("failed")
        cut = hosts("link", f"{PREFIX}-1", "up")
        assert cut.returncode == 0, cut.stderr
        deadline = time.monotonic() + 10
        while (got := connect(f"{PREFIX}-0", "198.51.100.11")).startswith("failed"):
            assert time.monotonic() < deadline, got
    finally:
        down = hosts("down")
        assert down.returncode == 0, down.stderr
        server.wait(timeout=10)  # `down` ended it: it ran in one of our namespaces
        if shutil.which("iptables"):  # a machine without it has no drop rule to remove
            sh(*drop_rule("-D"), check=False)
    assert leftovers() == []
