"""What each actor of ``rlfleet up --ray`` runs (a member of ``rlfleet.launch.plan`` and what
only Ray adds to it) and how it asks Ray for room: pure planning, no Ray import at module
level (``actor_options`` imports it when called)."""

from __future__ import annotations

import math
import os
from typing import Any

from rlfleet.common.config.ray import RayConfig, RayRoleConfig, demand
from rlfleet.launch.plan import PlannedRole, scaled_member
from rlfleet.launch.ray_actors import RoleSpec

DASHBOARD_ACTOR = RayRoleConfig(num_cpus=0.0)
"""What the dashboard's actor asks of Ray: no CPU slot (a page that idles while nobody
watches it must not keep a replica from starting). It has no ``ray.roles`` entry: it always
goes to the launcher's own node, where its loopback address (``dashboard.host``) is the
user's."""


ANY_PORT = {"rollout": ("rollout.port=0",)}
"""Overrides of members without a fixed port: several replicas may share a node, so each binds
any free port (and registers it in Redis)."""


def role_spec(
    member: PlannedRole, port: int | None = None, extra: tuple[str, ...] = ()
) -> RoleSpec:
    """A planned member as its actor runs it: ``port`` for a ``fixed_port`` member (the same
    after a restart), and what only Ray adds (``extra``, ``ANY_PORT``). The dashboard binds
    ``dashboard.host`` as configured (loopback by default: the page shows prompts and answers),
    not its node's address like the servers."""
    extra = (*extra, *ANY_PORT.get(member.verb, ()))
    return RoleSpec(
        member, port if member.fixed_port else None, extra, node_host=member.verb != "dashboard"
    )


def scaled_spec(role: str, index: int) -> RoleSpec:
    """A member ``rlfleet scale`` adds (``plan.scaled_member``): a replica, or a worker-only
    env process; neither has a fixed port."""
    return role_spec(scaled_member(role, index))


def local_cpus(ray: RayConfig, actors: dict[str, int]) -> int:
    """CPUs a local cluster advertises: ``ray.num_cpus``, else the larger of this machine's
    cores and what the fleet asks for (``actors``: role -> count; pools counted whole)."""
    if ray.num_cpus is not None:
        return ray.num_cpus
    asked = sum(b.get("CPU", 0.0) for pool in ray.pools.values() for b in pool.bundles)
    asked += sum(
        count * role_demand(ray, role).num_cpus
        for role, count in actors.items()
        if role_demand(ray, role).pool is None
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
