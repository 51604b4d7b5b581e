"""The fleet plan (``rlfleet.launch.plan``): which roles run for which config and launch
choices, in which order, with which overrides; that both backends start exactly its members;
and that the static deployments (docker-compose.yml, deploy/k8s/) run the roles it plans, so
neither can drift from it unnoticed. Nothing here starts a process or a Ray cluster."""

from __future__ import annotations

import re
from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from rlfleet.common.config import load_config
from rlfleet.launch.local import plan_children
from rlfleet.launch.plan import (
    FleetPlan,
    Phase,
    address_override,
    gateway_overrides,
    plan_fleet,
    plan_from_args,
    scaled_member,
)
from rlfleet.launch.ray_plan import role_spec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
REDIS = "redis://127.0.0.1:7/0"


def config(name: str | None = None, *overrides: str):
    return load_config(str(CONFIGS / name) if name else None, list(overrides))


def test_default_config_runs_servers_replicas_trainer_and_the_dashboard():
    plan = plan_fleet(config(), replicas=2)
    assert config().needs_refcritic  # the default job's KL term
    assert plan.names == [
        "router",
        "reward",
        "refcritic",
        "rollout-0",
        "rollout-1",
        "trainer",
        "dashboard",
    ]


def test_a_config_without_reference_or_critic_has_no_refcritic():
    assert "refcritic" not in plan_fleet(config("default.yaml"), 1).names
    ppo = plan_fleet(config("ppo_arith.yaml"), 1)  # the critic lives in refcritic
    assert config("ppo_arith.yaml").needs_critic and "refcritic" in ppo.names


def test_agent_config_adds_the_env_front_door_and_worker_only_processes():
    plan = plan_fleet(config("agent_calc.yaml"), replicas=1, env_processes=3)
    env = [m for m in plan.members if m.verb == "env"]
    assert [m.name for m in env] == ["env", "env-1", "env-2"]
    assert env[0].fixed_port and env[0].flags == () and env[0].section == "agent"
    assert all(m.flags == ("--worker-only",) and not m.fixed_port for m in env[1:])
    assert plan.scalable_counts() == {"rollout": 1, "env": 3}
    assert plan_fleet(config(), 2, env_processes=3).scalable_counts() == {"rollout": 2}


def test_no_trainer_and_dashboard_off_leave_them_out():
    plan = plan_fleet(config(None, "dashboard.enabled=false"), 2, trainer=False)
    assert plan.names == ["router", "reward", "refcritic", "rollout-0", "rollout-1"]
    args = Namespace(rollout_replicas=3, env_processes=1, no_trainer=True)
    assert "trainer" not in plan_from_args(config(), args).names


def test_one_start_order_servers_workers_trainer_dashboard():
    plan = plan_fleet(config("agent_calc.yaml", "algorithm.use_kl_in_reward=true"), 2, 2)
    phases = [member.phase for member in plan.members]
    assert phases == sorted(phases)
    assert [[m.name for m in group] for group in plan.phases()] == [
        ["router", "reward", "refcritic"],
        ["rollout-0", "rollout-1", "env", "env-1"],
        ["trainer"],
        ["dashboard"],
    ]
    assert [m.name for m in plan.addressed()] == ["router", "reward", "refcritic", "env", "trainer"]


def test_overrides_every_backend_shares():
    plan = plan_fleet(config(), replicas=3)
    by_name = {m.name: m for m in plan.members}
    assert by_name["rollout-2"].overrides == ("rollout.replica_id=rollout-2",)
    trainer = by_name["trainer"]
    assert trainer.overrides == ("trainer.min_replicas=3",) and trainer.finishes
    assert by_name["router"].port_override(5) == "router.port=5"
    assert address_override("env", "h:1") == "agent.address=h:1"
    assert address_override("trainer", "h:2") == "endpoints.trainer=h:2"
    assert scaled_member("rollout", 4) == plan_fleet(config(), 5).members[-3]
    assert gateway_overrides(config("agent_calc.yaml"), "http://h:9/v1") == (
        "agent.gateway_url=http://h:9/v1",
    )
    assert gateway_overrides(config(), "http://h:9/v1") == ()  # no agent.env


@pytest.mark.parametrize("name", [None, "agent_calc.yaml", "ppo_arith.yaml"])
@pytest.mark.parametrize("no_trainer", [False, True])
def test_both_backends_start_exactly_the_plan(tmp_path, name, no_trainer):
    args = Namespace(
        config=str(CONFIGS / name) if name else None,
        rollout_replicas=2,
        env_processes=2,
        no_trainer=no_trainer,
        overrides=[f"run_dir={tmp_path}"],
    )
    cfg = load_config(args.config, args.overrides)
    plan = plan_from_args(cfg, args)
    children = plan_children(cfg, args, REDIS, tmp_path)
    assert [c.name for c in children] == plan.names
    for child, member in zip(children, plan.members, strict=True):
        verb = child.argv.index("rlfleet.cli") + 1
        assert child.argv[verb] == member.verb and set(member.overrides) <= set(child.argv)
        assert set(member.flags) <= set(child.argv)
    specs = [role_spec(member, 50000) for member in plan.members]
    assert [(s.name, s.role, s.member.finishes) for s in specs] == [
        (m.name, m.verb, m.finishes) for m in plan.members
    ]
    assert all((s.port is not None) == s.member.fixed_port for s in specs)


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def every_role() -> set[str]:
    """Every verb some plan runs: refcritic, agent mode, trainer and dashboard all on."""
    return plan_fleet(config("agent_calc.yaml", "algorithm.use_kl_in_reward=true"), 1).verbs


def test_compose_runs_every_role_the_plan_knows_and_no_other():
    assert set(compose_services()) - {"redis"} == every_role()


@pytest.mark.parametrize("name", ["compose.yaml", "compose_agent.yaml"])
def test_compose_starts_what_the_plan_runs_for_its_configs(name):
    services = compose_services()
    started = {s for s, spec in services.items() if spec.get("scale", 1) != 0} - {"redis"}
    plan = plan_fleet(config(name), replicas=2)
    # A static file has no conditions: it runs refcritic even where an agent job needs none,
    # and the env service only when scaled up (--scale env=N) for compose_agent.yaml.
    assert plan.verbs - {"env"} <= started and started - plan.verbs <= {"refcritic"}
    assert ("env" in plan.verbs) == (name == "compose_agent.yaml")
    for member in plan.members:
        assert re.search(r"\brlfleet (\w+)", services[member.verb]["command"])[1] == member.verb


def test_compose_starts_the_trainer_after_what_the_plan_starts_before_it():
    plan = plan_fleet(config("compose.yaml"), replicas=2)
    before = {m.verb for m in plan.members if m.phase < Phase.TRAINER}
    assert set(compose_services()["trainer"]["depends_on"]) - {"redis"} == before


def k8s_roles() -> set[str]:
    spec = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    objects = [
        doc
        for name in spec["resources"]
        for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / name).read_text())
    ]
    pods = [o for o in objects if o and o["kind"] in ("Deployment", "Job")]
    return {
        o["spec"]["template"]["spec"]["containers"][0]["args"][1]
        for o in pods
        if o["metadata"]["name"] != "redis"
    }


def test_kubernetes_runs_every_role_the_plan_knows_and_no_other():
    assert k8s_roles() == every_role()
    shipped = plan_fleet(config("../deploy/k8s/config/rlfleet.yaml"), replicas=2)
    assert shipped.verbs <= k8s_roles()


def test_a_plan_is_a_plain_value():
    one, two = plan_fleet(config(), 2), plan_fleet(config(), 2)
    assert one == two and isinstance(one, FleetPlan) and hash(one) == hash(two)
    assert one.counts() == {
        "router": 1,
        "reward": 1,
        "refcritic": 1,
        "rollout": 2,
        "trainer": 1,
        "dashboard": 1,
    }
