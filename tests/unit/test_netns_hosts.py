"""scripts/netns_hosts.py's plans: what `up` and `down` would run, without running anything.

The commands themselves run in tests/integration/test_netns_hosts.py (root and namespaces
needed); here: names fit the kernel's limit, every host gets its own documentation-range
address, loopback and a route, the FORWARD rule `up` adds is exactly the one `down` deletes,
and what is not ours (another prefix, another range) is refused or left alone.
"""

from __future__ import annotations

import ipaddress

import pytest
from script_modules import load_script

nh = load_script("netns_hosts")


def test_hosts_get_consecutive_documentation_addresses_and_short_names():
    hosts = nh.hosts_for(3, "rlfh", "198.51.100.0/24")
    assert [(h.name, h.address) for h in hosts] == [
        ("rlfh-0", "198.51.100.10"),
        ("rlfh-1", "198.51.100.11"),
        ("rlfh-2", "198.51.100.12"),
    ]
    names = [n for h in hosts for n in (h.outer, h.inner)] + [nh.bridge_name("rlfh")]
    assert len(set(names)) == len(names) and max(map(len, names)) <= 15


@pytest.mark.parametrize("subnet", ["10.0.0.0/24", "192.168.1.0/24", "198.51.0.0/16"])
def test_a_subnet_outside_the_documentation_ranges_is_refused(subnet):
    with pytest.raises(ValueError, match="documentation"):
        nh.hosts_for(2, "rlfh", subnet)


@pytest.mark.parametrize("prefix", ["", "Rl", "rl-x", "toolongprefix", "1abc"])
def test_a_prefix_that_could_not_name_every_interface_is_refused(prefix):
    with pytest.raises(ValueError, match="prefix"):
        nh.hosts_for(2, prefix)


def test_too_many_hosts_for_the_subnet_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        nh.hosts_for(250, "rlfh", "203.0.113.0/24")
    assert len(nh.hosts_for(200, "rlfh", "203.0.113.0/24")) == 200


def test_up_makes_the_bridge_then_each_host_with_address_loopback_and_route():
    hosts = nh.hosts_for(2, "rlfq")
    plan = nh.plan_up(hosts)
    assert plan[:2] == [
        ["ip", "link", "add", "rlfq-br", "type", "bridge"],
        ["ip", "link", "set", "rlfq-br", "up"],
    ]
    for host in hosts:
        inside = ["ip", "-n", host.name]
        assert ["ip", "netns", "add", host.name] in plan
        assert ["ip", "link", "set", host.outer, "master", "rlfq-br"] in plan
        assert [*inside, "addr", "add", f"{host.address}/24", "dev", "eth0"] in plan
        assert [*inside, "link", "set", "lo", "up"] in plan
        assert [*inside, "route", "add", "default", "dev", "eth0"] in plan
        # the namespace exists before anything is moved into it
        moved = ["ip", "link", "set", host.inner, "netns", host.name]
        assert plan.index(["ip", "netns", "add", host.name]) < plan.index(moved)
    assert plan[-1][:3] == ["iptables", "-I", "FORWARD"]


def test_the_forward_rule_accepts_only_the_bridge_to_itself_and_down_deletes_that_rule():
    up_rule = nh.plan_up(nh.hosts_for(1, "rlfq"))[-1]
    down = nh.plan_down_names("rlfq", [], [], rules=2, bridge=False)
    assert up_rule[3:] == down[0][3:] == down[1][3:]
    spec = up_rule[3:]
    assert spec[spec.index("-i") + 1] == spec[spec.index("-o") + 1] == "rlfq-br"
    assert spec[-2:] == ["-j", "ACCEPT"] and "rlfleet-netns:rlfq" in spec
    assert [argv[:3] for argv in down] == [["iptables", "-D", "FORWARD"]] * 2


def test_without_iptables_up_adds_no_rule():
    assert all(argv[0] == "ip" for argv in nh.plan_up(nh.hosts_for(2, "rlfq"), iptables=False))


def test_down_removes_what_was_found_namespaces_first_bridge_after():
    plan = nh.plan_down_names("rlfq", ["rlfq-0", "rlfq-1"], ["rlfq2h"], rules=1, bridge=True)
    assert plan == [
        ["ip", "netns", "delete", "rlfq-0"],
        ["ip", "netns", "delete", "rlfq-1"],
        ["ip", "link", "delete", "rlfq2h"],
        ["ip", "link", "delete", "rlfq-br"],
        ["iptables", "-D", "FORWARD", *nh.forward_rule("rlfq")],
    ]
    assert nh.plan_down_names("rlfq", [], [], rules=0, bridge=False) == []


def test_every_address_lies_in_the_subnet_and_none_is_its_network_or_broadcast():
    network = ipaddress.ip_network("192.0.2.0/28")
    hosts = nh.hosts_for(5, "rlfh", str(network))
    addresses = [ipaddress.ip_address(h.address) for h in hosts]
    assert all(a in network for a in addresses)
    assert network.network_address not in addresses
    assert network.broadcast_address not in addresses
    with pytest.raises(ValueError, match="do not fit"):
        nh.hosts_for(6, "rlfh", str(network))
