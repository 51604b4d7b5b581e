"""``rlfleet up``: the whole fleet as local processes.

Starts the fleet's plan (``rlfleet.launch.plan``: router, reward, refcritic, N rollout
replicas, the env role, the trainer, the dashboard) after the embedded Redis
(``rlfleet.launch.session``); streams each one's output with a ``[name]`` prefix (and
into ``run_dir/logs``); and leaves nothing behind: when the trainer finishes, on Ctrl-C, or
when any service dies (then it says which one and why), every process it started is stopped,
by its own process group.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.pdeathsig import die_with_parent
from rlfleet.launch.peak_memory import PeakMemory
from rlfleet.launch.plan import (
    ADDRESS_KEYS,
    FleetPlan,
    PlannedRole,
    address_override,
    gateway_overrides,
    member_index,
    plan_from_args,
)
from rlfleet.launch.process import RoleProcess, free_port, role_argv, role_env, split_secrets
from rlfleet.launch.session import (
    fleet_redis_url,
    print_run_summary,
    say,
    start_redis,
    stop_on_signals,
)

STOP_GRACE_S = 10.0


def plan_children(config: RlfleetConfig, args, redis_url: str, log_dir: Path) -> list[RoleProcess]:
    """The fleet's plan (``rlfleet.launch.plan``) as processes, in its start order, with
    addresses filled in: 127.0.0.1 and a free port for each role that serves at one."""
    plan = plan_from_args(config, args)
    ports = {verb: free_port() for verb in ADDRESS_KEYS}
    overrides, secrets = split_secrets(args.overrides)  # secrets travel in the environment
    addresses = [address_override(verb, f"127.0.0.1:{port}") for verb, port in ports.items()]
    common = [*addresses, *overrides]
    env = role_env(redis_url, secrets)  # Redis too: its URL may hold a password
    # Every role gets SIGTERM if `rlfleet up` dies outright (SIGKILL): no fleet left running
    # on its own. Children are started and restarted from the main thread, the signal's anchor.
    die_with_us, _ = die_with_parent(signal.SIGTERM)
    http_port = config.router.http_port or free_port()  # the OpenAI-compatible API
    say(config, f"rlfleet up: router HTTP at {tls.scheme(config.tls)}://127.0.0.1:{http_port}/v1")
    record_endpoints(config, plan, ports, http_port, redis_url)
    dashboard, replica_metrics = dashboard_ports(config, args.rollout_replicas)
    if dashboard is not None:
        ports["dashboard"] = dashboard
    local = LocalRoles(config, ports, http_port, replica_metrics)
    children = []
    for member in plan.members:
        argv = role_argv(
            member.verb, args.config, [*common, *local.overrides(member)], member.flags
        )
        children.append(
            RoleProcess(
                member.name,
                [*die_with_us, *argv],
                {**env, **local.env(member)},
                log_dir / f"{member.name}.log",
            )
        )
    return children


@dataclass(frozen=True)
class LocalRoles:
    """What the local backend adds to a planned member: its port, the router's HTTP port, a
    replica's ``/metrics`` port and CPU binding, the env role's gateway."""

    config: RlfleetConfig
    ports: dict[str, int]
    http_port: int
    replica_metrics: list[int]

    def overrides(self, member: PlannedRole) -> list[str]:
        port = [member.port_override(self.ports[member.verb])] if member.fixed_port else []
        extra: tuple[str, ...] = ()
        if member.verb == "router":
            extra = (f"router.http_port={self.http_port}",)
        elif member.verb == "rollout" and self.replica_metrics:
            extra = (f"rollout.metrics_port={self.replica_metrics[member_index(member.name)]}",)
        elif member.verb == "env":  # workflows' and verifiers' OpenAI base
            base = f"{tls.scheme(self.config.tls)}://127.0.0.1:{self.http_port}/v1"
            extra = gateway_overrides(self.config, base)
        return [*port, *member.overrides, *extra]

    def env(self, member: PlannedRole) -> dict[str, str]:
        """Replica ``i`` on core ``i`` (vLLM's CPU backend), unless the user bound them."""
        if member.verb != "rollout":
            return {}
        core = member_index(member.name) % (os.cpu_count() or 1)
        return {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", str(core))}


def record_endpoints(config, plan: FleetPlan, ports: dict, http_port: int, redis_url: str) -> None:
    """Every role's address in ``run_dir/endpoints.json`` (services add what they bind)."""
    from rlfleet.common.endpoints import describe, write_endpoints
    from rlfleet.common.entry import safe_url

    roles = {"redis": {"url": safe_url(redis_url)}}
    for member in plan.addressed():
        roles[member.name] = {"grpc": f"127.0.0.1:{ports[member.verb]}"}
    roles["router"]["http"] = f"{tls.scheme(config.tls)}://127.0.0.1:{http_port}/v1"
    for role, addresses in roles.items():
        write_endpoints(config.run_dir, role, addresses)
        say(config, f"rlfleet up: {describe(role, addresses)}")


def dashboard_ports(config: RlfleetConfig, replicas: int) -> tuple[int | None, list[int]]:
    """The dashboard's port (None: ``dashboard.enabled`` is off) and a ``/metrics`` port per
    replica, whose prefix-cache counters the page shows (none when the user set
    ``rollout.metrics_port``: one port for every replica would clash). Both are recorded in
    ``run_dir/endpoints.json`` (``dashboard``, ``rollout-<i>``) and the page's URL printed."""
    from rlfleet.common.endpoints import write_endpoints

    if not config.dashboard.enabled:
        return None, []
    host, port = config.dashboard.host, config.dashboard.port or free_port()
    metrics = [] if config.rollout.metrics_port else [free_port() for _ in range(replicas)]
    scheme = tls.scheme(config.tls)
    for i, metrics_port in enumerate(metrics):
        url = f"{scheme}://{config.rollout.host}:{metrics_port}/metrics"
        write_endpoints(config.run_dir, f"rollout-{i}", {"metrics": url})
    write_endpoints(config.run_dir, "dashboard", {"http": f"{scheme}://{host}:{port}/"})
    key = " (open it with ?key=<api_key>)" if config.api_key else ""
    say(config, f"rlfleet up: dashboard at {scheme}://{host}:{port}/{key}")
    return port, metrics


def stop_all(children: list[RoleProcess]) -> None:
    for child in reversed(children):
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        while child.exited() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        child.signal(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait()


def supervise(
    children: list[RoleProcess], replica_restarts: int = 0, peaks: PeakMemory | None = None
) -> int:
    """Wait for the trainer (or any failure); return the exit code for ``rlfleet up``.

    Rollout replicas are expendable: one that dies is started again (same replica id) up to
    ``replica_restarts`` times each while the run goes on; any other service's exit stops
    the fleet. ``peaks`` reads the roles' peak memory as it goes."""
    trainer = next((c for c in children if c.name == "trainer"), None)
    restarts: dict[str, int] = {}
    while True:
        if peaks is not None:
            peaks.sample(live_groups(children))
        if trainer is not None and (code := trainer.exited()) is not None:
            if code:
                report_failure(trainer, code)
            return code
        for child in children:
            code = child.exited()
            if child is trainer or code is None:
                continue
            if is_replica(child) and code == 0:  # drained (DrainReplica): it is done
                print(
                    f"rlfleet up: replica '{child.name}' was drained and exited",
                    file=sys.stderr,
                    flush=True,
                )
                children.remove(child)
                break
            if is_replica(child) and restarts.get(child.name, 0) < replica_restarts:
                restarts[child.name] = restarts.get(child.name, 0) + 1
                restart_replica(child, code, restarts[child.name], replica_restarts)
                continue
            report_failure(child, code)
            return 1
        time.sleep(0.2)


def live_groups(children: list[RoleProcess]) -> dict[str, int]:
    """Role name -> process group id (its leader's pid) of the children still running."""
    return {c.name: c.proc.pid for c in children if c.proc is not None and c.exited() is None}


def is_replica(child: RoleProcess) -> bool:
    return child.name.startswith("rollout-")


def restart_replica(child: RoleProcess, code: int, attempt: int, limit: int) -> None:
    print(
        f"rlfleet up: replica '{child.name}' exited with code {code}; restarting it "
        f"({attempt}/{limit}), the run goes on (its log: {child.log_path})",
        file=sys.stderr,
        flush=True,
    )
    child.kill_group()  # what is left of its process group (vLLM's engine core) goes with it
    child.start()


def report_failure(child: RoleProcess, code: int) -> None:
    tail = "\n".join(f"    {line}" for line in child.tail[-10:])
    print(
        f"\nrlfleet up: service '{child.name}' exited with code {code}; stopping the "
        f"fleet. Last output:\n{tail}\n(full log: {child.log_path})",
        file=sys.stderr,
    )


def run_local(config: RlfleetConfig, args) -> int:
    """``rlfleet up``'s whole life with local processes; returns its exit code."""
    run_dir = Path(config.run_dir)
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    redis = start_redis(config, run_dir)
    redis_url = fleet_redis_url(config, redis)
    children: list[RoleProcess] = []
    with stop_on_signals():
        try:
            children = plan_children(config, args, redis_url, log_dir)
            for child in children:
                child.start()
            peaks = PeakMemory(run_dir / "peak_rss.json")
            code = supervise(children, config.rollout.max_restarts, peaks)
            if code == 0 and not args.no_trainer:
                print_run_summary(run_dir / "summary.json")
            if peaks.peaks_kib:
                say(config, f"rlfleet up: {peaks.summary_line()} ({peaks.path})")
            return code
        except KeyboardInterrupt:
            print("\nrlfleet up: interrupted, stopping the fleet", file=sys.stderr)
            return 130
        finally:
            stop_all(children)
            if redis is not None:
                redis.stop()
