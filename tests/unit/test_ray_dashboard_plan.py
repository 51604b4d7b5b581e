"""The dashboard under `rlfleet up --ray`, planned without a cluster: what its actor binds,
what it asks Ray for, and what the launcher records of it (tests/integration/
test_ray_launcher.py checks the page of a real Ray fleet)."""

from __future__ import annotations

from rlfleet.common.config import load_config
from rlfleet.common.config.ray import demand
from rlfleet.launch.plan import plan_fleet
from rlfleet.launch.ray_actors import RoleActor
from rlfleet.launch.ray_plan import role_demand, role_restarts, role_spec
from rlfleet.launch.ray_up import RayFleet


def test_the_dashboard_keeps_its_configured_host_and_starts_last():
    plan = plan_fleet(load_config(None, []), replicas=1)
    member = plan.members[-1]  # after the trainer, whose address it is given (every backend)
    spec = role_spec(member, 8265)
    assert (spec.name, spec.role, spec.port) == ("dashboard", "dashboard", 8265)
    assert spec.overrides == () and not spec.node_host
    actor = RoleActor.__new__(RoleActor)  # only its planning, no Ray and no process
    actor.spec, actor.host = spec, "10.0.0.2"
    assert actor._bind() == ["dashboard.port=8265"]  # dashboard.host stays loopback


def test_the_dashboard_asks_for_no_cpu_and_restarts_like_the_rest():
    config = load_config(None, ["ray.max_restarts=5", "ray.roles.reward.max_restarts=1"])
    assert demand(role_demand(config.ray, "dashboard")) == {}
    assert role_restarts(config.ray, "dashboard") == 5
    assert role_restarts(config.ray, "reward") == 1
    assert role_demand(config.ray, "reward") is config.ray.roles.reward


def test_the_launcher_records_the_page_on_the_dashboard_host():
    config = load_config(None, ["dashboard.host=127.0.0.1"])
    fleet = RayFleet.__new__(RayFleet)
    fleet.config = config
    assert fleet.endpoints_of("dashboard", "10.0.0.2:8265", 9000) == {
        "http": "http://127.0.0.1:8265/"
    }
    assert fleet.endpoints_of("router", "10.0.0.2:50051", 9000) == {
        "grpc": "10.0.0.2:50051",
        "http": "http://10.0.0.2:9000/v1",
    }
    assert fleet.endpoints_of("rollout-0", None, 9000) == {}
    config.tls.cert_file, config.tls.key_file = "c.pem", "k.pem"  # the dashboard serves https
    assert fleet.endpoints_of("dashboard", "10.0.0.2:8265", 9000)["http"].startswith("https://")
