"""Where ``rlfleet slurm`` puts the fleet's members on a Slurm job's nodes, and what it checks
before a script goes to the queue.

Why labels: ``rlfleet up --ray`` places each actor by what its role asks of Ray
(``ray.roles.<role>``: CPUs, GPUs, custom resources, a pool). A Slurm job's nodes are alike,
so CPU and GPU counts alone would scatter the servers and the trainer over whichever node has
room. The job's script starts Ray's head with the custom resource ``rlfleet_head`` and every
other node with ``rlfleet_worker``; the launcher's command line asks each role for one unit of
its side's label. The members a fleet scales (rollout replicas, env processes:
``plan.SCALABLE``) go to the workers; every other member to the head, next to the launcher
(its driver), the embedded Redis and the dashboard. One node: all of it on the head.

Which members there are is the fleet plan's (``rlfleet.launch.plan``), as for ``rlfleet up``
and ``rlfleet up --ray``; nothing here lists roles. Pure: no Slurm, no Ray, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.common.config.ray import RayRolesConfig, demand
from rlfleet.launch.plan import SCALABLE, FleetPlan, PlannedRole
from rlfleet.launch.ray_plan import role_demand

if TYPE_CHECKING:
    from rlfleet.common.config import RlfleetConfig

HEAD, WORKER = "rlfleet_head", "rlfleet_worker"
LABEL_UNITS = 1000
"""How much of its label a node offers: a label, not a limit (CPUs and GPUs bound what fits)."""
RAY_ROLES = frozenset(RayRolesConfig.model_fields)
"""Roles Ray places by ``ray.roles.<role>`` (the dashboard goes to the launcher's node)."""
BUILT_IN = frozenset({"CPU", "GPU", "memory", HEAD, WORKER})
"""Resources every node of the job offers (Ray's own, and the two labels)."""


@dataclass(frozen=True)
class SlurmJob:
    """What the job asks of Slurm, and how its script starts Ray."""

    nodes: int = 1
    """Nodes of the job: the head (Ray's head, the launcher) and ``nodes - 1`` workers."""
    cpus_per_task: int = 8
    """CPUs of each node's one task, all of them given to Ray (``ray start --num-cpus``)."""
    gpus_per_node: int = 0
    """GPUs of each node, all of them given to Ray."""
    partition: str | None = None
    time: str | None = None
    """Slurm's time limit (``1-00:00:00``, ``90``); None = the partition's default."""
    job_name: str = "rlfleet"
    log_file: str = "rlfleet-slurm-%j.out"
    """The job's output (Slurm's ``--output``, relative to ``workdir``)."""
    workdir: str = "."
    """Where the job runs (``--chdir``): relative paths of the config resolve from it."""
    ray_port: int = 6379
    """The port of Ray's head (its GCS)."""
    wait_s: int = 300
    """How long the script waits for every node to join Ray before it gives up."""
    setup: tuple[str, ...] = ()
    """Shell lines run first on the head (``source ~/venv/bin/activate``); srun's steps
    inherit the environment they set."""
    sbatch: tuple[str, ...] = ()
    """More ``#SBATCH`` options, as typed (``--account=ml``)."""

    def check(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1 (the head), got {self.nodes}")
        if self.cpus_per_task < 1 or self.gpus_per_node < 0:
            raise ValueError("--cpus-per-task must be >= 1 and --gpus-per-node >= 0")
        if not 0 < self.ray_port < 65536:
            raise ValueError(f"--ray-port must be a TCP port, got {self.ray_port}")

    def room(self) -> dict[str, float]:
        """What Ray may place on one node."""
        return {"CPU": float(self.cpus_per_task), "GPU": float(self.gpus_per_node)}


def side(member: PlannedRole, nodes: int) -> str:
    """The label of the nodes ``member`` runs on: the workers for the members a fleet scales
    (when there are workers), the head for every other one."""
    return WORKER if nodes > 1 and member.verb in SCALABLE else HEAD


def layout(plan: FleetPlan, nodes: int) -> dict[str, list[str]]:
    """Member names by label, in start order: ``{HEAD: [...], WORKER: [...]}``."""
    placed: dict[str, list[str]] = {HEAD: [], WORKER: []}
    for member in plan.members:
        placed[side(member, nodes)].append(member.name)
    return placed


def placed_by_label(config: RlfleetConfig, verb: str) -> bool:
    """Whether Ray places ``verb``'s actors by its ``ray.roles`` resources (not the dashboard,
    which goes to the launcher's node, nor a role in a pool: its placement group does)."""
    return verb in RAY_ROLES and config.ray.role(verb).pool is None


def placement_overrides(config: RlfleetConfig, plan: FleetPlan, nodes: int) -> tuple[str, ...]:
    """``ray.roles.<role>.resources.<label>=1`` for each role of the plan Ray places by label,
    beside the resources the config already asks for."""
    labels: dict[str, str] = {}
    for member in plan.members:
        if placed_by_label(config, member.verb):
            labels.setdefault(member.verb, side(member, nodes))
    return tuple(f"ray.roles.{verb}.resources.{label}=1" for verb, label in labels.items())


def check_resources(config: RlfleetConfig, plan: FleetPlan) -> None:
    """Refuse custom resources no node of the job offers: Ray would wait for them forever."""
    asked = {
        f"ray.roles.{verb}": set(config.ray.role(verb).resources)
        for verb in sorted(plan.verbs & RAY_ROLES)
    }
    asked |= {
        f"ray.pools.{name}": {key for bundle in pool.bundles for key in bundle}
        for name, pool in config.ray.pools.items()
    }
    unknown = {where: sorted(keys - BUILT_IN) for where, keys in asked.items() if keys - BUILT_IN}
    if unknown:
        raise ValueError(
            f"custom resources no node of a Slurm job offers: {unknown}; its nodes offer "
            f"{sorted(BUILT_IN)} (rlfleet slurm places roles on the head or the workers itself)"
        )


def unplaced(config: RlfleetConfig, plan: FleetPlan, job: SlurmJob) -> list[str]:
    """Members for which no node of their side has CPUs and GPUs left: first fit, the biggest
    asks first (pooled roles left out: their placement groups reserve their room)."""
    rooms = {HEAD: [job.room()], WORKER: [job.room() for _ in range(job.nodes - 1)]}
    members = [
        m for m in plan.members if m.verb not in RAY_ROLES or placed_by_label(config, m.verb)
    ]
    asks = {m.name: cpu_gpu(config, m.verb) for m in members}
    left = []
    for member in sorted(members, key=lambda m: (-asks[m.name]["GPU"], -asks[m.name]["CPU"])):
        want = asks[member.name]
        room = next((r for r in rooms[side(member, job.nodes)] if holds(r, want)), None)
        if room is None:
            left.append(member.name)
            continue
        for key, amount in want.items():
            room[key] -= amount
    return left


def cpu_gpu(config: RlfleetConfig, verb: str) -> dict[str, float]:
    asked = demand(role_demand(config.ray, verb))
    return {"CPU": asked.get("CPU", 0.0), "GPU": asked.get("GPU", 0.0)}


def holds(room: dict[str, float], want: dict[str, float]) -> bool:
    return all(room[key] >= amount for key, amount in want.items())


def check_fits(config: RlfleetConfig, plan: FleetPlan, job: SlurmJob) -> None:
    """Every member of the plan fits the job's nodes, or a ``ValueError`` saying what to ask."""
    left = unplaced(config, plan, job)
    if not left:
        return
    asks = {verb: cpu_gpu(config, verb) for verb in sorted({m.verb for m in plan.members})}
    raise ValueError(
        f"{job.nodes} node(s) of {job.cpus_per_task} CPUs and {job.gpus_per_node} GPUs cannot "
        f"hold {left} (the head takes {layout(plan, job.nodes)[HEAD]}, the workers the rest; "
        f"each member asks {asks}): ask for more --nodes, --cpus-per-task or --gpus-per-node, "
        "fewer --rollout-replicas, or less per role (ray.roles.<role>.num_cpus)"
    )


def up_arguments(
    config_path: str | None, replicas: int, env_processes: int, overrides: list[str]
) -> list[list[str]]:
    """``rlfleet up --ray ADDRESS``'s arguments after the address, a line of the script each:
    the same fleet as the plan's (replicas, env processes), then each of ``overrides`` (the
    user's, then the placement's)."""
    options = ["--config", config_path] if config_path else []
    options += ["--rollout-replicas", str(replicas), "--env-processes", str(env_processes)]
    return [options, *([item] for item in overrides)]
