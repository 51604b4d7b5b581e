"""The Ray actors of ``rlfleet up --ray``: one ``RoleActor`` per role process, and the named
``FleetControl`` that ``rlfleet scale`` talks to.

Why an actor runs the role as a subprocess instead of in-actor: a role's entry point owns its
process. It runs its own asyncio loop and signal handlers, sets torch threads and OpenMP policy
before torch loads, and (vLLM) spawns engine children that need a ``__main__`` guard. Running
the very command ``rlfleet up`` runs (``rlfleet VERB ...``) keeps one code path for every
launcher, and a Ray worker's own threads and object store stay out of the role's way. Ray does
what it is good at: placing the actor (resources, pools), and restarting it (``max_restarts``).
The two lifetimes are tied both ways: the child gets SIGKILL when its actor's process dies
(``PR_SET_PDEATHSIG``), and the actor exits with a failure when its child dies, so Ray restarts
the pair. A trainer that exits 0 has finished: its actor stays up and reports the code.

Ray is imported only inside methods: this module is imported on the driver before ``ray.init``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.common.pdeathsig import die_with_parent
from rlfleet.launch.plan import PlannedRole

STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class RoleSpec:
    """One role process of the fleet as its actor runs it: a member of the fleet's plan
    (``rlfleet.launch.plan``) and what only Ray adds to it."""

    member: PlannedRole
    port: int | None = None
    """The port a ``fixed_port`` member binds (the same after a restart); None = the role picks."""
    extra: tuple[str, ...] = ()
    """Overrides only Ray adds (the router's HTTP port; ``rollout.port=0``)."""
    node_host: bool = True
    """Bind the node's address (or ``Launch.host``), so other nodes reach it; False keeps the
    config's host (the dashboard: loopback unless the user opens it up)."""

    @property
    def name(self) -> str:
        """Actor and log name: ``router``, ``rollout-0``, ``trainer``."""
        return self.member.name

    @property
    def role(self) -> str:
        """The config role (``rollout`` for every replica): resources and pool come from it."""
        return self.member.verb

    @property
    def overrides(self) -> tuple[str, ...]:
        return (*self.member.overrides, *self.extra)


@dataclass(frozen=True)
class Launch:
    """What every role process shares: how to build its command line and environment."""

    config_path: str | None
    common: tuple[str, ...]
    """Overrides for every role (endpoints, the user's overrides, run_dir); nothing secret."""
    redis_url: str
    """Every role's ``RLFLEET_REDIS_URL`` (in its environment: the URL may hold a password)."""
    log_dir: str
    cwd: str
    host: str | None = None
    """Interface every role binds (None = its node's IP, reachable from other nodes)."""
    secrets: dict[str, str] = field(default_factory=dict)
    """``RLFLEET_*`` variables for settings kept off command lines (``split_secrets``)."""


class RoleActor:
    """Starts ``rlfleet VERB`` for one role on this actor's node and supervises it."""

    def __init__(self, spec: RoleSpec, launch: Launch) -> None:
        import ray

        self.spec = spec
        self.node_ip = ray.util.get_node_ip_address()
        self.host = launch.host or self.node_ip
        self.stopping = False
        self.code: int | None = None
        self.child = self._start_role(launch)  # on this (main) thread: the death signal's anchor
        self._announce()
        threading.Thread(target=self._watch, daemon=True).start()

    def _start_role(self, launch: Launch):
        from rlfleet.launch.process import RoleProcess, role_argv, role_env

        if os.path.isdir(launch.cwd):  # relative paths in the config mean the driver's folder
            os.chdir(launch.cwd)
        Path(launch.log_dir).mkdir(parents=True, exist_ok=True)
        overrides = [*launch.common, *self._bind(), *self.spec.overrides]
        argv = role_argv(self.spec.role, launch.config_path, overrides, self.spec.member.flags)
        log = Path(launch.log_dir) / f"{self.spec.name}.log"
        prefix, preexec = die_with_parent(signal.SIGKILL)  # the actor's death ends the role
        env = role_env(launch.redis_url, launch.secrets)
        child = RoleProcess(self.spec.name, [*prefix, *argv], env, log)
        child.start(preexec_fn=preexec)
        return child

    def _announce(self) -> None:
        import ray

        with warnings.catch_warnings():  # Ray's own property calls a deprecated getter
            warnings.simplefilter("ignore")
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        print(
            f"[ray] {self.spec.name} {'re' if restarted else ''}started on node {self.node_ip} "
            f"(actor pid {os.getpid()}, role pid {self.child.proc.pid})",
            flush=True,
        )

    def __repr__(self) -> str:  # Ray prefixes forwarded output with this: "(rollout-0 pid=...)"
        return self.spec.name

    def _bind(self) -> list[str]:
        member = self.spec.member
        port = [member.port_override(self.spec.port)] if self.spec.port else []
        host = [f"{member.section}.host={self.host}"] if self.spec.node_host else []
        return [*host, *port]

    def _watch(self) -> None:
        """When the role process ends: done (a finished trainer), or crash this actor so Ray
        restarts it, or nothing (we are stopping it)."""
        code = self.child.proc.wait()
        if self.stopping or (code == 0 and self.spec.member.finishes):
            self.code = code
            return
        print(
            f"[ray] {self.spec.name}: role process exited with {code}; "
            "failing the actor so Ray restarts it",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(0.5)  # let the output pump flush the role's last lines
        os._exit(1)

    def info(self) -> dict:
        import ray

        return {
            "name": self.spec.name,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": self.node_ip,
            "address": f"{self.host}:{self.spec.port}" if self.spec.port else None,
            "actor_pid": os.getpid(),
            "role_pid": self.child.proc.pid,
        }

    def exit_code(self) -> int | None:
        """The role's exit code once it finished (or was stopped); None while it runs."""
        return self.code

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the role's process group, SIGKILL what is left after ``grace_s``."""
        self.stopping = True
        self.child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.child.exited() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        self.child.signal(signal.SIGKILL)
        self.code = self.child.proc.wait()
        return self.code


class FleetControl:
    """The running launcher's mailbox, a named actor: ``rlfleet scale`` sets the wanted count
    of a role, the driver reads it and starts or stops actors to match."""

    def __init__(self, wanted: dict[str, int]) -> None:
        self.wanted = dict(wanted)

    def scale(self, role: str, count: int) -> int:
        """Ask for ``count`` actors of ``role``; returns the count asked for before."""
        if role not in self.wanted:
            raise ValueError(f"cannot scale {role!r}; scalable: {sorted(self.wanted)}")
        if count < 1:
            raise ValueError(f"{role} needs at least 1 actor, got {count}")
        before, self.wanted[role] = self.wanted[role], count
        return before

    def wanted_counts(self) -> dict[str, int]:
        return dict(self.wanted)
