"""What a static deployment (docker-compose.yml, deploy/k8s/) runs, read off the fleet plan.

Why: those files were written by hand, and a test compared them with the plan after the fact;
every new role had to be added there a third and a fourth time. Now the renderers (``compose``,
``k8s``) take one ``StaticRole`` per verb of the plan and add only what is theirs: images,
probes, volumes, resources, the prose around them.

A static deployment differs from ``rlfleet up`` in three ways, all decided here:

- One service (a Deployment) per verb. The members of a scalable role (``plan.SCALABLE``) are
  copies scaled at run time (``--scale rollout=N``, ``kubectl scale``); each copy takes its
  container's or pod's name as its id (``plan.IDENTITY_KEYS``), and every env copy serves the
  front door (they share the env stream, so any of them takes the trainer's episodes).
- It describes every role the plan knows (``plan_fleet(..., agent=True)``): a role the mounted
  config does not run (the env role without ``agent.env``) is there at scale 0.
- The fleet's size is not baked into a command: the operator picks it (compose), or the
  config's ``trainer.min_replicas`` sets the rollout Deployment's replicas (Kubernetes).

Pure: no I/O, the same roles for the same config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.common.config.loading import ENV_OVERRIDES
from rlfleet.launch.plan import (
    ADDRESS_KEYS,
    IDENTITY_KEYS,
    SCALABLE,
    FleetPlan,
    Phase,
    PlannedRole,
    identity_override,
    plan_fleet,
)

if TYPE_CHECKING:
    from rlfleet.common.config import RlfleetConfig

ANY_HOST = "0.0.0.0"
FIXED_PORTS = {"dashboard": 8265}
"""The port a role gets where the config leaves it free (0): in a container it must be known
before the start, for the health check and the published port."""
HTTP_ROLES = frozenset({"dashboard"})
"""Roles whose health is HTTP ``/healthz``; every other one serves ``grpc.health.v1``."""
ENGINE_ROLES = frozenset({"rollout"})
"""Roles that run an inference engine: vLLM's CPU backend sets NUMA memory policy (the
``SYS_NICE`` capability) and keeps its worker queues in shared memory (``/dev/shm``)."""
ADVERTISE_KEYS = {"rollout": "rollout.advertise_host"}
"""Roles that register their own address in Redis, so the router reaches each copy directly
(no service in front): each copy advertises its container's or pod's address."""
EXTRA_PORTS = ("http_port", "metrics_port")
"""A role's other ports, where its config section sets them: ``http`` (a front door: the
router's OpenAI API) and ``metrics`` (Prometheus, scraped from each copy)."""


@dataclass(frozen=True)
class StaticRole:
    """One verb of the plan as a static deployment runs it."""

    verb: str
    """Service, Deployment and container name: ``router``, ``rollout``, ``env``."""
    phase: Phase
    port: int
    """The port it serves (gRPC; HTTP for ``HTTP_ROLES``) and is probed on."""
    overrides: tuple[str, ...]
    """Dotted overrides after ``--config``: its fixed host and port where the config lacks
    them, and its own id (``IDENTITY``, replaced by the backend)."""
    count: int
    """Copies the mounted config runs; 0: described, off until that config turns it on."""
    address_variable: str | None
    """``RLFLEET_<VERB>_ADDR``: how every role is told where it serves; None: nobody is."""
    finishes: bool
    """A job (the trainer): exit 0 is done, not a crash to restart."""
    waits_for: tuple[str, ...]
    """Verbs it starts after, once they are healthy (the members of earlier phases)."""
    extra_ports: tuple[tuple[str, int], ...]
    """(name, port): ``http`` and ``metrics`` where its config section sets them."""

    @property
    def scalable(self) -> bool:
        return self.verb in SCALABLE

    @property
    def http(self) -> bool:
        return self.verb in HTTP_ROLES

    @property
    def engine(self) -> bool:
        return self.verb in ENGINE_ROLES

    @property
    def advertise_key(self) -> str | None:
        return ADVERTISE_KEYS.get(self.verb)


IDENTITY = "{identity}"
"""Where ``rollout.replica_id=`` puts the copy's own name (``StaticRole.argv``)."""


def static_roles(config: RlfleetConfig) -> list[StaticRole]:
    """One ``StaticRole`` per verb the plan knows for ``config``, in start order."""
    replicas = config.trainer.min_replicas
    described = plan_fleet(config, replicas, agent=True)
    running = plan_fleet(config, replicas).counts()
    firsts: dict[str, PlannedRole] = {}  # each verb's first member: the env front door
    for member in described.members:
        firsts.setdefault(member.verb, member)
    return [
        static_role(config, member, running.get(verb, 0), described, running)
        for verb, member in firsts.items()
    ]


def static_role(
    config: RlfleetConfig,
    member: PlannedRole,
    count: int,
    plan: FleetPlan,
    running: dict[str, int],
) -> StaticRole:
    section = getattr(config, member.section)
    port = section.port or FIXED_PORTS[member.verb]
    overrides = [f"{member.section}.host={ANY_HOST}"] if section.host != ANY_HOST else []
    if not section.port:
        overrides.append(member.port_override(port))
    if member.verb in IDENTITY_KEYS:
        overrides.append(identity_override(member.verb, IDENTITY))
    earlier = [m.verb for m in plan.members if m.phase < member.phase]
    waits = member.phase == Phase.TRAINER  # the servers, the workers and the observer do not
    return StaticRole(
        verb=member.verb,
        phase=member.phase,
        port=port,
        overrides=tuple(overrides),
        count=count,
        address_variable=address_variable(member, plan),
        finishes=member.finishes,
        waits_for=tuple(v for v in dict.fromkeys(earlier) if running.get(v)) if waits else (),
        extra_ports=tuple(
            (name.removesuffix("_port"), value)
            for name in EXTRA_PORTS
            if (value := getattr(section, name, None))
        ),
    )


def address_variable(member: PlannedRole, plan: FleetPlan) -> str | None:
    """The ``RLFLEET_*`` variable that sets ``ADDRESS_KEYS[verb]``, for an addressed member."""
    if member not in plan.addressed():
        return None
    (variable,) = (v for v, key in ENV_OVERRIDES.items() if key == ADDRESS_KEYS[member.verb])
    return variable


def argv(role: StaticRole, config_path: str, identity: str) -> list[str]:
    """``rlfleet VERB --config PATH [OVERRIDES]``, the copy's id being ``identity``."""
    overrides = [o.replace(IDENTITY, identity) for o in role.overrides]
    return ["rlfleet", role.verb, "--config", config_path, *overrides]
