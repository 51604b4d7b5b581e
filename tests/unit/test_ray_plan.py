"""`rlfleet up --ray` without a cluster: the `ray:` config section, the command line, and what
each actor asks Ray for (tests/integration/test_ray_launcher.py runs it on real clusters)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.config import load_config
from rlfleet.common.config.ray import RayConfig
from rlfleet.launch.plan import env_process, member_index, member_name, plan_from_args, replica
from rlfleet.launch.ray_actors import FleetControl, RoleActor
from rlfleet.launch.ray_plan import actor_options, local_cpus, role_spec, scaled_spec
from rlfleet.launch.up import parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_ray_section_defaults_and_partial_roles():
    config = load_config(None, ["launcher=ray", "ray.roles={reward: {resources: {node2: 1}}}"])
    assert config.launcher == "ray"
    assert config.ray.role("reward").resources == {"node2": 1.0}
    assert config.ray.role("trainer").num_cpus == 1.0
    assert config.ray.restarts("reward") == config.ray.max_restarts == 3
    dotted = load_config(None, ["ray.roles.trainer.num_gpus=1", "ray.roles.trainer.max_restarts=0"])
    assert dotted.ray.role("trainer").num_gpus == 1 and dotted.ray.restarts("trainer") == 0


@pytest.mark.parametrize(
    "roles, pools, message",
    [
        ({"router": {"pool": "main"}}, {}, "not in ray.pools"),
        ({"trainer": {"pool": "p", "num_gpus": 1}}, {"p": {"bundles": [{"CPU": 4}]}}, "fit"),
        ({}, {"p": {"bundles": []}}, "non-empty"),
        ({"nope": {}}, {}, "nope"),
    ],
)
def test_ray_section_rejects_bad_pools(roles, pools, message):
    with pytest.raises(ValidationError, match=message):
        RayConfig(roles=roles, pools=pools)


@pytest.mark.parametrize(
    "argv, address, overrides",
    [
        (["--ray"], "", []),
        (["--ray", "10.0.0.1:6379", "a.b=1"], "10.0.0.1:6379", ["a.b=1"]),
        (["--ray", "trainer.total_steps=5", "x.y=2"], "", ["trainer.total_steps=5", "x.y=2"]),
        (["trainer.total_steps=5"], None, ["trainer.total_steps=5"]),
    ],
)
def test_up_reads_ray_flag_with_or_without_address(argv, address, overrides):
    args = parse_args(argv)
    assert (args.ray, args.overrides) == (address, overrides)


def test_local_cluster_cpus_cover_what_the_fleet_asks_for():
    ray = RayConfig(
        roles={"trainer": {"num_cpus": 4, "pool": "main"}, "rollout": {"num_cpus": 2}},
        pools={"main": {"bundles": [{"CPU": 6}, {"CPU": 2}]}},
    )
    actors = {"router": 1, "reward": 1, "rollout": 8, "trainer": 1}
    assert local_cpus(ray, actors) == max(os.cpu_count(), 8 + 1 + 1 + 16)  # pool counted whole
    assert local_cpus(RayConfig(num_cpus=3), actors) == 3


def test_actor_options_carry_resources_and_restarts():
    ray = RayConfig(
        max_restarts=5,
        roles={
            "rollout": {"num_cpus": 0.5, "num_gpus": 1, "resources": {"node2": 1}},
            "trainer": {"max_restarts": 0},
        },
    )
    options = actor_options(ray, "rollout", "rollout-0", {})
    assert options["num_cpus"] == 0.5 and options["num_gpus"] == 1
    assert options["resources"] == {"node2": 1.0} and options["max_restarts"] == 5
    assert "scheduling_strategy" not in options
    assert actor_options(ray, "trainer", "trainer", {})["max_restarts"] == 0


def test_replicas_keep_their_id_and_take_any_port():
    spec = role_spec(replica(3), 50555)  # no fixed port: the port is not used
    assert spec.name == "rollout-3" and spec.role == "rollout" and spec.port is None
    assert spec.overrides == ("rollout.replica_id=rollout-3", "rollout.port=0")


def test_env_role_front_door_and_worker_only_members():
    front = role_spec(env_process(0), 50555)
    assert (front.name, front.role, front.port, front.member.flags) == ("env", "env", 50555, ())
    worker = role_spec(env_process(2), 0)
    assert (worker.name, worker.port, worker.member.flags) == ("env-2", None, ("--worker-only",))
    assert scaled_spec("env", 3) == role_spec(env_process(3))
    assert scaled_spec("rollout", 1) == role_spec(replica(1))
    assert [member_index(n) for n in ("env", "env-2", "rollout-0", "rollout-11")] == [0, 2, 0, 11]
    assert [member_name("env", 0), member_name("env", 1), member_name("rollout", 0)] == [
        "env",
        "env-1",
        "rollout-0",
    ]


def test_env_binds_the_agent_section():
    actor = RoleActor.__new__(RoleActor)  # only its planning, no Ray and no process
    actor.spec, actor.host = role_spec(env_process(0), 50555), "10.0.0.2"
    assert actor._bind() == ["agent.host=10.0.0.2", "agent.port=50555"]
    actor.spec = role_spec(replica(0))
    assert actor._bind() == ["rollout.host=10.0.0.2"]


def test_agent_mode_makes_env_scalable_and_counts_its_cpus():
    agent = load_config(str(ROOT / "configs" / "agent_calc.yaml"), [])
    args = parse_args(["--env-processes", "3", "--rollout-replicas", "2"])
    counts = plan_from_args(agent, args).scalable_counts()
    assert counts == {"rollout": 2, "env": 3}
    assert plan_from_args(load_config(None, []), args).scalable_counts() == {"rollout": 2}
    control = FleetControl(counts)
    assert control.scale("env", 5) == 3 and control.wanted_counts()["env"] == 5
    with pytest.raises(ValueError, match="at least 1"):
        control.scale("env", 0)
    roles = RayConfig(num_cpus=None, roles={"env": {"num_cpus": 2}})
    actors = {"router": 1, **counts}  # 2 replicas, 3 env processes
    assert local_cpus(roles, actors) == max(os.cpu_count(), 1 + 2 + 2 * 3)
    actors = plan_from_args(agent, args).counts()  # the dashboard asks for no CPU
    assert actors["dashboard"] == 1 and local_cpus(roles, actors) == max(os.cpu_count(), 9 + 2)
