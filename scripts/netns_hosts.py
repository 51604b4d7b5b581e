#!/usr/bin/env python3
"""Several hosts on one machine, for real: network namespaces joined to a bridge by veth pairs.

Why: what goes wrong between hosts (an address that is not loopback, a node that vanishes, a
link that drops) never shows when every role runs on 127.0.0.1. A network namespace has its
own interfaces, addresses, routes, loopback and firewall, so a process started in one (``ip
netns exec HOST ...``) sees the others only across the bridge, by their addresses, as on a
LAN. (They still share the machine's hostname, filesystem, /dev/shm and process table: what
must behave as across machines has to decide by address, not by those.)

    netns_hosts.py up --hosts 3      # rlfh-0 198.51.100.10, rlfh-1 .11, rlfh-2 .12
    netns_hosts.py down              # every namespace, veth, bridge, rule and process of ours
    netns_hosts.py lose rlfh-1       # a host lost: its processes SIGKILLed, namespace removed
    netns_hosts.py link rlfh-1 down  # its cable pulled (the bridge side of its veth), or up
    netns_hosts.py up --hosts 2 --dry-run   # print the commands instead

Host ``PREFIX-i`` (namespace) has ``eth0`` with address ``SUBNET + 10 + i``, loopback up, and a
default route on ``eth0`` (programs that find their own address by a route lookup, as Ray
does, find it; no gateway answers, so nothing leaves the bridge). The bridge ``PREFIX-br`` has
no address: the machine's own namespace is not on this network. Only addresses from the
documentation ranges are accepted, and none the machine itself uses.

The bridge's traffic passes the machine's iptables FORWARD chain when ``br_netfilter`` is
loaded; Docker, for one, leaves a FORWARD policy of DROP behind. So ``up`` inserts its own
``-i BR -o BR -j ACCEPT`` rule (tagged with a comment naming the prefix) and ``down`` removes
every rule with that tag; no other rule of the machine is read or changed. ``down`` finds what
is ours by name (``PREFIX-<n>`` namespaces, ``PREFIX<n>h`` veths, ``PREFIX-br``, the tagged
rules), so it also clears what a failed or interrupted ``up`` left. Processes in our
namespaces (``ip netns pids``) get SIGTERM, then SIGKILL, before their namespace goes.

Plans (``plan_up``, ``plan_down_names``) are pure lists of argv: tests/unit/test_netns_hosts.py
checks them; tests/integration/test_netns_hosts.py makes two hosts and connects them.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

DOC_RANGES = tuple(
    ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
)
"""RFC 5737's documentation ranges: never anyone's real network."""
DEFAULT_SUBNET = "198.51.100.0/24"
DEFAULT_PREFIX = "rlfh"
FIRST_HOST = 10
"""Host i gets the subnet's address 10 + i."""
IFNAMSIZ = 15
KILL_GRACE_S = 3.0

Argv = list[str]


@dataclass(frozen=True)
class Host:
    index: int
    prefix: str
    address: str
    prefix_len: int

    @property
    def name(self) -> str:
        """The namespace: ``ip netns exec NAME ...``."""
        return f"{self.prefix}-{self.index}"

    @property
    def outer(self) -> str:
        """The veth end on the bridge, in the machine's namespace: pulled for a link cut."""
        return f"{self.prefix}{self.index}h"

    @property
    def inner(self) -> str:
        """The veth end moved into the namespace (renamed ``eth0`` there)."""
        return f"{self.prefix}{self.index}n"


def bridge_name(prefix: str) -> str:
    return f"{prefix}-br"


def rule_tag(prefix: str) -> str:
    return f"rlfleet-netns:{prefix}"


def forward_rule(prefix: str) -> Argv:
    """The FORWARD rule's spec (after ``-I FORWARD`` / ``-D FORWARD``)."""
    bridge = bridge_name(prefix)
    tag = ["-m", "comment", "--comment", rule_tag(prefix)]
    return ["-i", bridge, "-o", bridge, *tag, "-j", "ACCEPT"]


def check_prefix(prefix: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise ValueError(f"prefix {prefix!r}: 1-8 lowercase letters and digits, a letter first")


def hosts_for(count: int, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET) -> list[Host]:
    """``count`` hosts in ``subnet`` (a documentation range), named ``PREFIX-0`` ..."""
    check_prefix(prefix)
    network = ipaddress.ip_network(subnet)
    if not any(network.subnet_of(doc) for doc in DOC_RANGES if doc.version == network.version):
        raise ValueError(f"{subnet}: only documentation ranges ({', '.join(map(str, DOC_RANGES))})")
    if count < 1 or FIRST_HOST + count - 1 > network.num_addresses - 2:  # no broadcast
        raise ValueError(f"{count} hosts do not fit in {subnet} from .{FIRST_HOST}")
    if len(f"{prefix}{count - 1}h") > IFNAMSIZ:
        raise ValueError(f"interface names of prefix {prefix!r} exceed {IFNAMSIZ} characters")
    addresses = list(network)
    return [
        Host(i, prefix, str(addresses[FIRST_HOST + i]), network.prefixlen) for i in range(count)
    ]


def plan_host(host: Host, bridge: str) -> list[Argv]:
    """The commands that make one host and plug it into ``bridge``."""
    inside = ["ip", "-n", host.name]
    return [
        ["ip", "netns", "add", host.name],
        ["ip", "link", "add", host.outer, "type", "veth", "peer", "name", host.inner],
        ["ip", "link", "set", host.inner, "netns", host.name],
        ["ip", "link", "set", host.outer, "master", bridge],
        ["ip", "link", "set", host.outer, "up"],
        [*inside, "link", "set", host.inner, "name", "eth0"],
        [*inside, "addr", "add", f"{host.address}/{host.prefix_len}", "dev", "eth0"],
        [*inside, "link", "set", "lo", "up"],
        [*inside, "link", "set", "eth0", "up"],
        [*inside, "route", "add", "default", "dev", "eth0"],
    ]


def plan_up(hosts: list[Host], iptables: bool = True) -> list[Argv]:
    """Bridge, hosts, and (``iptables``: the tool is installed) the FORWARD rule."""
    bridge = bridge_name(hosts[0].prefix)
    commands = [
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "link", "set", bridge, "up"],
    ]
    for host in hosts:
        commands += plan_host(host, bridge)
    if iptables:
        commands.append(["iptables", "-I", "FORWARD", *forward_rule(hosts[0].prefix)])
    return commands


def plan_down_names(
    prefix: str, namespaces: list[str], links: list[str], rules: int, bridge: bool
) -> list[Argv]:
    """Remove what was found: ``namespaces``, leftover veth ends ``links``, the bridge, and
    ``rules`` copies of the FORWARD rule. (Processes are killed before, by ``kill_in``.)"""
    commands = [["ip", "netns", "delete", name] for name in namespaces]
    commands += [["ip", "link", "delete", link] for link in links]
    if bridge:
        commands.append(["ip", "link", "delete", bridge_name(prefix)])
    commands += [["iptables", "-D", "FORWARD", *forward_rule(prefix)] for _ in range(rules)]
    return commands


# ---- what is there now (I/O) ---------------------------------------------------------------


def run(argv: Argv, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def our_namespaces(prefix: str) -> list[str]:
    listed = run(["ip", "netns", "list"], check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    return [name for name in names if re.fullmatch(rf"{re.escape(prefix)}-\d+", name)]


def our_links(prefix: str) -> list[str]:
    out = run(["ip", "-o", "link", "show"], check=False).stdout
    names = [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", out, re.MULTILINE)]
    return [name for name in names if re.fullmatch(rf"{re.escape(prefix)}\d+h", name)]


def has_bridge(prefix: str) -> bool:
    return run(["ip", "link", "show", bridge_name(prefix)], check=False).returncode == 0


def our_rules(prefix: str) -> int:
    """How many FORWARD rules carry our tag (0 without iptables)."""
    if not shutil.which("iptables"):
        return 0
    listed = run(["iptables", "-S", "FORWARD"], check=False).stdout
    tagged = re.compile(rf'--comment "?{re.escape(rule_tag(prefix))}"?(\s|$)')
    return sum(bool(tagged.search(line)) for line in listed.splitlines())


def pids_in(namespace: str) -> list[int]:
    out = run(["ip", "netns", "pids", namespace], check=False).stdout
    return [int(pid) for pid in out.split() if pid.isdigit() and int(pid) != os.getpid()]


def kill_in(namespace: str, grace_s: float = KILL_GRACE_S) -> list[int]:
    """SIGTERM every process in ``namespace``, SIGKILL what is left after ``grace_s``
    (``grace_s`` 0: SIGKILL at once). Returns the pids signalled."""
    pids = pids_in(namespace)
    first = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
    for pid in pids:
        signal_pid(pid, first)
    deadline = time.monotonic() + grace_s
    while pids_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids_in(namespace):
        signal_pid(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def cannot_make_namespaces() -> str | None:
    """Why this machine cannot make our hosts (not root, no ``ip``, no namespaces), or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if not shutil.which("ip"):
        return "needs iproute2's ip"
    probe = f"rlfprobe{os.getpid()}"
    made = run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    run(["ip", "netns", "delete", probe], check=False)
    return None


def execute(commands: list[Argv], dry_run: bool) -> None:
    for argv in commands:
        print("+ " + " ".join(argv), flush=True)
        if not dry_run:
            run(argv)


def machine_addresses() -> list[str]:
    out = run(["ip", "-o", "addr", "show"], check=False).stdout
    return re.findall(r"inet6? ([0-9a-f.:]+)/", out)


# ---- verbs ----------------------------------------------------------------------------------


def up(args) -> int:
    hosts = hosts_for(args.hosts, args.prefix, args.subnet)
    network = ipaddress.ip_network(args.subnet)
    taken = [a for a in machine_addresses() if ipaddress.ip_address(a) in network]
    if taken:
        sys.exit(f"netns_hosts: the machine itself uses {taken} in {args.subnet}; pick another")
    if not args.dry_run and (our_namespaces(args.prefix) or has_bridge(args.prefix)):
        sys.exit(f"netns_hosts: hosts of prefix {args.prefix!r} exist; run `down` first")
    iptables = shutil.which("iptables") is not None
    if not iptables:
        print("netns_hosts: iptables is not installed: no FORWARD rule added", file=sys.stderr)
    try:
        execute(plan_up(hosts, iptables), args.dry_run)
    except subprocess.CalledProcessError as exc:
        print(f"netns_hosts: {exc.cmd} failed: {exc.stderr.strip()}; undoing", file=sys.stderr)
        down(args)
        return 1
    for host in hosts:
        print(f"{host.name} {host.address}")
    return 0


def down(args) -> int:
    namespaces = our_namespaces(args.prefix)
    if not args.dry_run:
        for name in namespaces:
            kill_in(name)
    commands = plan_down_names(
        args.prefix, namespaces, [], our_rules(args.prefix), has_bridge(args.prefix)
    )
    execute(commands, args.dry_run)
    if not args.dry_run:
        remove_leftover_links(args.prefix)
    return 0


def remove_leftover_links(prefix: str, settle_s: float = 3.0) -> None:
    """Delete veth ends a failed ``up`` left behind. The kernel removes a deleted namespace's
    veth pairs asynchronously, so a link listed a moment ago may be gone by the time we delete
    it ("Cannot find device"): that is success, not an error. Raises if one stays."""
    deadline = time.monotonic() + settle_s
    while (links := our_links(prefix)) and time.monotonic() < deadline:
        time.sleep(0.1)  # most leftovers are veths still being torn down with their namespace
    for name in links:
        print(f"+ ip link delete {name}", flush=True)
        gone = run(["ip", "link", "delete", name], check=False)
        if gone.returncode != 0 and "Cannot find device" not in gone.stderr:
            raise subprocess.CalledProcessError(
                gone.returncode, gone.args, gone.stdout, gone.stderr
            )


def lose(args) -> int:
    """A host lost whole: every process in it SIGKILLed at once, then its namespace deleted."""
    killed = [] if args.dry_run else kill_in(args.host, grace_s=0)
    execute([["ip", "netns", "delete", args.host]], args.dry_run)
    print(f"{args.host}: killed {len(killed)} processes, namespace deleted")
    return 0


def link(args) -> int:
    prefix, index = args.host.rsplit("-", 1)
    execute([["ip", "link", "set", f"{prefix}{index}h", args.state]], args.dry_run)
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", default=DEFAULT_PREFIX)
    common.add_argument("--dry-run", action="store_true", help="print the commands only")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    make = verbs.add_parser("up", parents=[common], help="make the hosts")
    make.add_argument("--hosts", type=int, default=3)
    make.add_argument("--subnet", default=DEFAULT_SUBNET)
    verbs.add_parser("down", parents=[common], help="remove every host, rule and process of ours")
    lost = verbs.add_parser("lose", parents=[common], help="SIGKILL a host's processes, delete it")
    lost.add_argument("host")
    cut = verbs.add_parser("link", parents=[common], help="set a host's link down or up")
    cut.add_argument("host")
    cut.add_argument("state", choices=("down", "up"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return {"up": up, "down": down, "lose": lose, "link": link}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
