"""Config of ``rlfleet up --ray``: which Ray cluster, what each role asks of it, and the
resource pools (placement groups) roles share.

Why pools: a role's actor can go wherever its resources fit, or into a pool reserved up front
as a placement group of bundles, the way verl maps roles to resource pools. Several roles in one
pool are colocated (``PACK``/``STRICT_PACK`` on one node), and the reservation is all or
nothing, so a fleet never half-starts for want of a GPU. Nothing here imports Ray.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import model_validator

from rlfleet.common.config.base import Section

RayRole = Literal["router", "rollout", "reward", "refcritic", "env", "trainer"]
PoolStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class RayRoleConfig(Section):
    num_cpus: float = 1.0
    """CPUs reserved for each actor of this role (Ray's logical ``num_cpus``)."""
    num_gpus: float = 0.0
    """GPUs reserved for each actor of this role; Ray sets ``CUDA_VISIBLE_DEVICES`` for it."""
    resources: dict[str, float] = {}
    """Custom resources each actor needs, e.g. ``{node2: 1}`` to pin it to the node started
    with ``ray start --resources '{"node2": 1}'``."""
    pool: str | None = None
    """Name of a pool in ``ray.pools`` whose placement group the actors go into (None = placed
    anywhere their resources fit). Roles naming the same pool are colocated."""
    max_restarts: int | None = None
    """How often Ray restarts a crashed actor of this role (None = ``ray.max_restarts``)."""


class RayPoolConfig(Section):
    bundles: list[dict[str, float]] = [{"CPU": 1.0}]
    """The placement group's bundles, each a resource dict (``{CPU: 2, GPU: 1}``). Each actor
    of the pool's roles must fit in one bundle; actors share bundles while room is left."""
    strategy: PoolStrategy = "PACK"
    """Ray placement strategy: ``PACK``/``STRICT_PACK`` keep the bundles on one node (colocation),
    ``SPREAD``/``STRICT_SPREAD`` put them on different nodes."""


class RayRolesConfig(Section):
    """What each role's actors ask of Ray (``ray.roles.trainer.num_gpus=1``)."""

    router: RayRoleConfig = RayRoleConfig()
    """The router's actor."""
    rollout: RayRoleConfig = RayRoleConfig()
    """Each rollout replica's actor."""
    reward: RayRoleConfig = RayRoleConfig()
    """The reward service's actor."""
    refcritic: RayRoleConfig = RayRoleConfig()
    """The refcritic's actor (started only when the config needs a reference or a critic)."""
    env: RayRoleConfig = RayRoleConfig()
    """Each env process's actor (agent mode, ``agent.env`` set): the front door and its
    workers, and every ``--worker-only`` one ``rlfleet scale env=N`` adds."""
    trainer: RayRoleConfig = RayRoleConfig()
    """The trainer's actor."""


class RayConfig(Section):
    address: str | None = None
    """Ray cluster to join (``host:port``, ``auto`` or ``ray://...``); None = start a local
    cluster and stop it at the end. ``rlfleet up --ray ADDRESS`` wins."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster (None = this machine's cores, or what the fleet asks for
    at start if that is more; scaling past that leaves new replicas pending)."""
    num_gpus: int | None = None
    """GPUs of a local cluster (None = what Ray detects)."""
    object_store_memory_mb: int = 100
    """Object store of a local cluster. The fleet moves weights over gRPC, not Ray objects, so
    it stays small (Ray's default reserves 30% of RAM)."""
    temp_dir: str | None = None
    """Folder in which a local cluster gets a fresh folder of its own for Ray's session files,
    removed at the end (None = /tmp). Keep it short: Ray puts Unix sockets there (107 bytes)."""
    namespace: str = "rlfleet"
    """Ray namespace of the fleet's named actors (the control actor ``rlfleet scale`` finds)."""
    max_restarts: int = 3
    """How often Ray restarts a crashed role actor (replicas and reward re-register; the
    trainer resumes from its newest checkpoint with ``trainer.resume_mode=auto``)."""
    start_timeout_s: float = 300.0
    """How long placement groups and server roles may take to come up before ``up`` fails."""
    roles: RayRolesConfig = RayRolesConfig()
    """Per-role resource requests and pool."""
    pools: dict[str, RayPoolConfig] = {}
    """Resource pools by name (``ray.pools.NAME.bundles``, ``.strategy``), reserved as placement
    groups before any role starts."""

    @model_validator(mode="after")
    def _check_pools(self) -> RayConfig:
        for role in get_args(RayRole):
            spec = self.role(role)
            if spec.pool is None:
                continue
            if spec.pool not in self.pools:
                raise ValueError(f"ray.roles.{role}.pool={spec.pool!r} is not in ray.pools")
            if not any(fits(spec, bundle) for bundle in self.pools[spec.pool].bundles):
                raise ValueError(f"ray.roles.{role} does not fit in any bundle of pool {spec.pool}")
        for name, pool in self.pools.items():
            if not pool.bundles or not all(pool.bundles):
                raise ValueError(f"ray.pools.{name}.bundles must be non-empty resource dicts")
        return self

    def role(self, role: str) -> RayRoleConfig:
        return getattr(self.roles, role)

    def restarts(self, role: str) -> int:
        spec = self.role(role)
        return self.max_restarts if spec.max_restarts is None else spec.max_restarts


def demand(spec: RayRoleConfig) -> dict[str, float]:
    """What one actor of a role asks for, in Ray's resource names."""
    wanted = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
    return {name: amount for name, amount in wanted.items() if amount}


def fits(spec: RayRoleConfig, bundle: dict[str, float]) -> bool:
    return all(bundle.get(name, 0.0) >= amount for name, amount in demand(spec).items())
