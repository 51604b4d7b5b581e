"""``run_dir/endpoints.json``: roles merge into one file, and ``rlfleet up`` records its plan."""

from __future__ import annotations

import json

from rlfleet.common.config import load_config
from rlfleet.common.endpoints import read_endpoints, write_endpoints
from rlfleet.launch.local import record_endpoints
from rlfleet.launch.plan import plan_fleet


def test_roles_merge_and_a_role_replaces_its_own_entry(tmp_path):
    assert read_endpoints(tmp_path) == {}
    write_endpoints(tmp_path, "reward", {"grpc": "127.0.0.1:1"})
    write_endpoints(tmp_path, "router", {"grpc": "127.0.0.1:2"})
    write_endpoints(tmp_path, "reward", {"grpc": "127.0.0.1:3", "http": "http://127.0.0.1:4"})
    assert json.loads((tmp_path / "endpoints.json").read_text()) == {
        "reward": {"grpc": "127.0.0.1:3", "http": "http://127.0.0.1:4"},
        "router": {"grpc": "127.0.0.1:2"},
    }


def test_up_records_every_role_it_starts(tmp_path, capsys):
    config = load_config(None, [f"run_dir={tmp_path}"])
    ports = {"router": 1, "reward": 2, "refcritic": 3, "trainer": 4, "env": 7}
    plan = plan_fleet(config, replicas=1, trainer=False)
    record_endpoints(config, plan, ports, 5, "redis://127.0.0.1:6/0")
    recorded = read_endpoints(tmp_path)
    assert recorded["router"] == {"grpc": "127.0.0.1:1", "http": "http://127.0.0.1:5/v1"}
    assert recorded["reward"] == {"grpc": "127.0.0.1:2"} and "trainer" not in recorded
    assert recorded["redis"] == {"url": "redis://127.0.0.1:6/0"}
    assert "rlfleet up: reward: grpc=127.0.0.1:2" in capsys.readouterr().out
