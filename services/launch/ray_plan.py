"""What ``rlfleet up --ray`` starts, and how each actor asks Ray for room: pure planning,
no Ray import at module level (``actor_options`` imports it when called)."""

from __future__ import annotations

import math
import os
from typing import Any

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.config.ray import RayConfig, RayRoleConfig, demand
from rlfleet.launch.ray_actors import RoleSpec

SERVER_ROLES = ("router", "reward", "refcritic")
"""Started first: their addresses (node IP + port) go into every other role's endpoints."""
DASHBOARD_ACTOR = RayRoleConfig(num_cpus=0.0)
"""What the dashboard's actor asks of Ray: no CPU slot (a page that idles while nobody
watches it must not keep a replica from starting). It has no ``ray.roles`` entry: it always
goes to the launcher's own node, where its loopback address (``dashboard.host``) is the
user's."""


def replica_spec(index: int) -> RoleSpec:
    """Replica ``index``: a stable id (a restart resumes its stream), any free port (several
    replicas may share a node)."""
    name = f"rollout-{index}"
    return RoleSpec(name, "rollout", (f"rollout.replica_id={name}", "rollout.port=0"))


def env_spec(index: int, port: int) -> RoleSpec:
    """Env process ``index`` of agent mode. 0 is ``env``: the front door the trainer calls
    (a fixed port, like the servers), with its own ``agent.workers``. Every other one,
    ``env-<index>``, runs only workers (``--worker-only``) on the same Redis stream: episodes
    scale out with them."""
    if index == 0:
        return RoleSpec("env", "env", (), port)
    return RoleSpec(f"env-{index}", "env", (), None, flags=("--worker-only",))


def scaled_spec(role: str, index: int) -> RoleSpec:
    """A member ``rlfleet scale`` adds: replica ``rollout-<index>``, or worker-only env
    process ``env-<index>`` (index >= 1: the front door ``env`` is started once, and kept)."""
    return replica_spec(index) if role == "rollout" else env_spec(index, 0)


def member_index(name: str) -> int:
    """``rollout-3`` -> 3, ``env-2`` -> 2, ``env`` (the env front door) -> 0."""
    return int(name.rsplit("-", 1)[1]) if "-" in name else 0


def member_name(role: str, index: int) -> str:
    return "env" if (role, index) == ("env", 0) else f"{role}-{index}"


def server_specs(config: RlfleetConfig, ports: dict[str, int], http_port: int) -> list[RoleSpec]:
    roles = ["router", "reward"] + (["refcritic"] if config.needs_refcritic else [])
    extra = {"router": (f"router.http_port={http_port}",)}
    return [RoleSpec(role, role, extra.get(role, ()), ports[role]) for role in roles]


def dashboard_spec(port: int, trainer_address: str | None) -> RoleSpec:
    """The live page, started last: it probes every other role, the trainer included. It
    binds ``dashboard.host`` as configured (loopback by default: the page shows prompts and
    answers), not its node's address like the servers."""
    extra = (f"endpoints.trainer={trainer_address}",) if trainer_address else ()
    return RoleSpec("dashboard", "dashboard", extra, port, node_host=False)


def trainer_spec(port: int, replicas: int) -> RoleSpec:
    return RoleSpec("trainer", "trainer", (f"trainer.min_replicas={replicas}",), port, True)


def endpoint_overrides(addresses: dict[str, str]) -> list[str]:
    """``endpoints.*`` for the roles that call the servers (the trainer)."""
    return [f"endpoints.{role}={address}" for role, address in addresses.items() if address]


def local_cpus(ray: RayConfig, actors: dict[str, int]) -> int:
    """CPUs a local cluster advertises: ``ray.num_cpus``, else the larger of this machine's
    cores and what the fleet asks for (``actors``: role -> count; pools counted whole)."""
    if ray.num_cpus is not None:
        return ray.num_cpus
    asked = sum(b.get("CPU", 0.0) for pool in ray.pools.values() for b in pool.bundles)
    asked += sum(
        count * ray.role(role).num_cpus
        for role, count in actors.items()
        if ray.role(role).pool is None
    )
    return max(os.cpu_count() or 1, math.ceil(asked))


def role_demand(ray_config: RayConfig, role: str) -> RayRoleConfig:
    """What each actor of ``role`` asks of Ray: ``ray.roles.<role>``, or the dashboard's."""
    return DASHBOARD_ACTOR if role == "dashboard" else ray_config.role(role)


def role_restarts(ray_config: RayConfig, role: str) -> int:
    return ray_config.max_restarts if role == "dashboard" else ray_config.restarts(role)


def on_this_node():
    """A scheduling strategy for the node this driver runs on (and nowhere else)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def actor_options(ray_config: RayConfig, role: str, name: str, groups: dict) -> dict[str, Any]:
    """``ActorClass.options(...)`` for one actor of ``role``: resources, restarts, and its
    pool's placement group when it has one (any bundle with room); the dashboard goes to the
    launcher's node."""
    spec = role_demand(ray_config, role)
    options: dict[str, Any] = {
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.num_gpus,
        "resources": {k: v for k, v in demand(spec).items() if k not in ("CPU", "GPU")},
        "max_restarts": role_restarts(ray_config, role),
        "max_task_retries": -1,  # a status call in flight when it crashed waits for the restart
    }
    if role == "dashboard":
        options["scheduling_strategy"] = on_this_node()
    elif spec.pool is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            groups[spec.pool], placement_group_bundle_index=-1
        )
    return options
