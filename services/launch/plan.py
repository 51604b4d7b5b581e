"""The fleet, written once: which roles ``rlfleet up`` runs, in what order, with what overrides.

Why: the role list used to be written for local processes and again for Ray, so every new role
(the env role, the dashboard) was added twice, in two different orders. Now both backends
start what ``plan_fleet`` lists and add only what they alone know: addresses and ports (local:
127.0.0.1 and free ports; Ray: the node a member landed on), environment variables, and how
they wait. The static deployments (docker-compose.yml, deploy/k8s/) are rendered from it
(``rlfleet.launch.manifests``, ``scripts/render_deploy.py``), and ``make test`` fails when the
committed files are not what it renders.

Pure: no backend, no I/O; a plan is the same for the same config and launch choices.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlfleet.common.config import RlfleetConfig


class Phase(IntEnum):
    """Start order, one for every backend. A backend starts a phase after the ones before it
    and learns the addresses of its ``fixed_port`` members before the next (Ray waits for their
    placement; locally every port is chosen up front, so the phases only order the starts)."""

    SERVERS = 0
    """Router, reward, refcritic: every later role is given their addresses."""
    WORKERS = 1
    """Rollout replicas and the env role (its front door's address goes to the trainer)."""
    TRAINER = 2
    OBSERVER = 3
    """The dashboard: it probes every other role, the trainer included."""


SCALABLE = ("rollout", "env")
"""Roles with several members that ``rlfleet scale`` may change while the fleet runs."""
CONFIG_SECTION = {"env": "agent"}
"""The config section holding a role's ``host`` and ``port`` where it is not the role's name."""
ADDRESS_KEYS = {
    "router": "endpoints.router",
    "reward": "endpoints.reward",
    "refcritic": "endpoints.refcritic",
    "trainer": "endpoints.trainer",
    "env": "agent.address",
}
"""The override through which every role is told where a role serves."""
IDENTITY_KEYS = {"rollout": "rollout.replica_id"}
"""The override through which a member of a scalable role is told its own stable id (a
static deployment gives it the container's or pod's name instead of ``rollout-<index>``)."""


@dataclass(frozen=True)
class PlannedRole:
    """One member of the fleet: one role process, whatever starts it."""

    name: str
    """Process, actor and log name: ``router``, ``rollout-0``, ``env-1``, ``trainer``."""
    verb: str
    """``rlfleet VERB``, also the config role (``rollout`` for every replica)."""
    phase: Phase
    overrides: tuple[str, ...] = ()
    """Dotted overrides of this member only (replica id, minimum replicas)."""
    flags: tuple[str, ...] = ()
    """Command-line flags (``--worker-only`` for an env process without a front door)."""
    fixed_port: bool = False
    """It serves at an address the backend chooses before it starts and tells the others."""
    finishes: bool = False
    """Exit code 0 means done (the trainer), not a crash to restart."""

    @property
    def section(self) -> str:
        """The config section of its ``host`` and ``port``."""
        return CONFIG_SECTION.get(self.verb, self.verb)

    def port_override(self, port: int) -> str:
        return f"{self.section}.port={port}"


def address_override(verb: str, address: str) -> str:
    """``endpoints.<verb>=ADDRESS`` (``agent.address`` for the env role): where ``verb`` serves."""
    return f"{ADDRESS_KEYS[verb]}={address}"


def gateway_overrides(config: RlfleetConfig, router_http: str) -> tuple[str, ...]:
    """The env role's OpenAI base (``agent.gateway_url``, for environments that drive a model)
    is the router's HTTP front ``router_http``, unless the user set one."""
    if not config.agent.env or config.agent.gateway_url:
        return ()
    return (f"agent.gateway_url={router_http}",)


def member_name(verb: str, index: int) -> str:
    """``rollout-<index>``; ``env`` for the env front door (index 0), ``env-<index>`` after."""
    return "env" if (verb, index) == ("env", 0) else f"{verb}-{index}"


def member_index(name: str) -> int:
    """``rollout-3`` -> 3, ``env-2`` -> 2, ``env`` (the env front door) -> 0."""
    return int(name.rsplit("-", 1)[1]) if "-" in name else 0


def replica(index: int) -> PlannedRole:
    """Replica ``index``: a stable id, so a restarted one resumes its own request stream."""
    name = member_name("rollout", index)
    return PlannedRole(name, "rollout", Phase.WORKERS, (identity_override("rollout", name),))


def identity_override(verb: str, name: str) -> str:
    """``rollout.replica_id=NAME``: the member's own id."""
    return f"{IDENTITY_KEYS[verb]}={name}"


def env_process(index: int) -> PlannedRole:
    """Env process ``index`` of agent mode. 0 is ``env``, the front door the trainer calls
    (a fixed port), with its own ``agent.workers``; every other one runs only workers
    (``--worker-only``) on the same Redis stream: episodes scale out with them."""
    if index == 0:
        return PlannedRole("env", "env", Phase.WORKERS, fixed_port=True)
    return PlannedRole(member_name("env", index), "env", Phase.WORKERS, flags=("--worker-only",))


def scaled_member(verb: str, index: int) -> PlannedRole:
    """A member ``rlfleet scale`` adds: replica ``rollout-<index>``, or worker-only env process
    ``env-<index>`` (index >= 1: the front door ``env`` is started once, and kept)."""
    return replica(index) if verb == "rollout" else env_process(index)


def server(verb: str) -> PlannedRole:
    return PlannedRole(verb, verb, Phase.SERVERS, fixed_port=True)


@dataclass(frozen=True)
class FleetPlan:
    """Every member of one fleet, in start order."""

    members: tuple[PlannedRole, ...]

    @property
    def names(self) -> list[str]:
        return [member.name for member in self.members]

    @property
    def verbs(self) -> set[str]:
        return {member.verb for member in self.members}

    def phases(self) -> list[tuple[PlannedRole, ...]]:
        """The members grouped by phase, in order (phases without members left out)."""
        return [group for phase in Phase if (group := self.in_phase(phase))]

    def in_phase(self, phase: Phase) -> tuple[PlannedRole, ...]:
        return tuple(member for member in self.members if member.phase == phase)

    def counts(self) -> dict[str, int]:
        """Members per verb: ``{"router": 1, "rollout": 2, ...}``."""
        return dict(Counter(member.verb for member in self.members))

    def scalable_counts(self) -> dict[str, int]:
        """What ``rlfleet scale`` may change, and the counts the fleet starts with."""
        return {verb: count for verb, count in self.counts().items() if verb in SCALABLE}

    def addressed(self) -> list[PlannedRole]:
        """The members other roles are told about (``ADDRESS_KEYS``), in start order."""
        return [
            member for member in self.members if member.fixed_port and member.verb in ADDRESS_KEYS
        ]


def plan_fleet(
    config: RlfleetConfig,
    replicas: int,
    env_processes: int = 1,
    trainer: bool = True,
    agent: bool | None = None,
) -> FleetPlan:
    """The fleet for ``config`` with ``replicas`` rollout replicas, ``env_processes`` env
    processes (agent mode), and the trainer unless ``trainer`` is False (``--no-trainer``).
    ``agent``: run the env role; None (every launcher) when ``config.agent.env`` names an
    environment, True for a static deployment, which describes the role whether or not the
    config it mounts turns agent mode on."""
    members = [server("router"), server("reward")]
    if config.needs_refcritic:
        members.append(server("refcritic"))
    members += [replica(i) for i in range(replicas)]
    with_env = bool(config.agent.env) if agent is None else agent
    if with_env:  # agent mode: episodes run in the env role, apart from the trainer
        members += [env_process(i) for i in range(env_processes)]
    if trainer:
        min_replicas = (f"trainer.min_replicas={replicas}",)
        members.append(
            PlannedRole(
                "trainer",
                "trainer",
                Phase.TRAINER,
                min_replicas,
                (),
                fixed_port=True,
                finishes=True,
            )
        )
    if config.dashboard.enabled:
        members.append(PlannedRole("dashboard", "dashboard", Phase.OBSERVER, fixed_port=True))
    return FleetPlan(tuple(members))


def plan_from_args(config: RlfleetConfig, args) -> FleetPlan:
    """``plan_fleet`` for ``rlfleet up``'s parsed command line."""
    return plan_fleet(config, args.rollout_replicas, args.env_processes, not args.no_trainer)
