"""``rlfleet up --ray [ADDRESS]``: the same fleet as ``rlfleet up``, each role a Ray actor.

Order: join the cluster (or start a local one), reserve the pools, start Redis (embedded,
on this machine, unless ``redis_url`` is set), then the fleet's plan (``rlfleet.launch.plan``)
phase by phase: the server roles (router, reward, refcritic), whose addresses Ray's placement
decides and every later role is given; the replicas and the env role; the trainer; the
dashboard. While the trainer runs, the launcher watches every actor (a role that crashes is
restarted by Ray up to ``max_restarts``; one that is out of restarts stops the fleet) and
follows ``rlfleet scale`` through the named ``FleetControl`` actor. At the end, on a failure
or on Ctrl-C, every actor is stopped (SIGTERM to its role, then killed), the pools are
released, and a local cluster is shut down with all its processes.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.config.ray import demand, fits
from rlfleet.common.ray_cluster import (
    Cluster,
    PlacementError,
    connect,
    one_machine,
    reserve_pools,
)
from rlfleet.launch.plan import (
    ADDRESS_KEYS,
    PlannedRole,
    address_override,
    gateway_overrides,
    member_index,
    member_name,
    plan_from_args,
)
from rlfleet.launch.process import free_port, split_secrets
from rlfleet.launch.ray_actors import STOP_GRACE_S, FleetControl, Launch, RoleActor, RoleSpec
from rlfleet.launch.ray_plan import actor_options, local_cpus, role_demand, role_spec, scaled_spec
from rlfleet.launch.session import (
    fleet_redis_url,
    print_run_summary,
    say,
    start_redis,
    stop_on_signals,
)

POLL_S = 1.0
PLACEMENT_FILE = "ray_placement.json"
"""``run_dir/ray_placement.json``: where each actor was placed (node, pids), for tools and tests."""


def control_name(cluster: str) -> str:
    """The named actor ``rlfleet scale`` looks up, one per fleet (``cluster``) on a Ray cluster."""
    return f"rlfleet-control-{cluster}"


class RayFleet:
    """The role actors of one fleet, started, watched, scaled and stopped from the driver."""

    def __init__(self, config: RlfleetConfig, args, launch: Launch, groups: dict, address: str):
        self.config, self.args, self.launch, self.groups = config, args, launch, groups
        self.address = address
        """The Ray cluster's address, recorded for ``rlfleet scale``."""
        self.plan = plan_from_args(config, args)
        self.actors: dict[str, Any] = {}
        """Ray actor handles by member name (Ray is untyped: ``Any``)."""
        self.roles: dict[str, str] = {}
        self.placed: dict[str, dict] = {}
        self.pending: dict = {}
        self.control: Any = None
        """The ``FleetControl`` actor's handle, once ``start_control`` ran."""

    def start_actor(self, spec: RoleSpec, launch: Launch):
        import ray

        options = actor_options(self.config.ray, spec.role, spec.name, self.groups)
        handle = ray.remote(RoleActor).options(**options).remote(spec, launch)
        self.actors[spec.name] = handle
        self.roles[spec.name] = spec.role
        return handle

    def start(self) -> None:
        """The plan's phases in order; after a phase with members at fixed addresses, wait
        until Ray placed them and tell every role started later where they are."""
        self.start_control()  # first: a fleet of the same name already there fails here
        http_port = self.config.router.http_port or free_port()
        for phase in self.plan.phases():
            for member in phase:
                self.start_actor(self.spec_of(member, http_port), self.launch)
            if any(member.fixed_port for member in phase):
                self.learn_addresses(phase, http_port)
        self.wait_placed()
        self.record(http_port)

    def spec_of(self, member: PlannedRole, http_port: int) -> RoleSpec:
        """Ray's port for a member with a fixed address (the dashboard's is on this node: see
        ``on_this_node``), and the router's HTTP port."""
        port = self.config.dashboard.port if member.verb == "dashboard" else 0
        extra = (f"router.http_port={http_port}",) if member.verb == "router" else ()
        return role_spec(member, (port or free_port()) if member.fixed_port else None, extra)

    def learn_addresses(self, phase: tuple[PlannedRole, ...], http_port: int) -> None:
        """Once ``phase`` is placed, its addresses go to every role started from now on
        (scaled ones included), before the user's overrides, as locally; so does the env
        role's gateway, the router's HTTP front."""
        self.wait_placed()
        addressed = [m for m in phase if m.fixed_port and m.verb in ADDRESS_KEYS]
        found = [address_override(m.verb, self.placed[m.name]["address"]) for m in addressed]
        self.launch = replace(self.launch, common=(*found, *self.launch.common))
        if any(member.verb == "router" for member in phase):
            router_host = self.placed["router"]["address"].rsplit(":", 1)[0]
            router_http = f"{tls.scheme(self.config.tls)}://{router_host}:{http_port}/v1"
            say(self.config, f"rlfleet up: router HTTP at {router_http}")
            gateway = gateway_overrides(self.config, router_http)
            self.launch = replace(self.launch, common=(*self.launch.common, *gateway))

    def start_control(self) -> None:
        import ray

        name = control_name(self.config.cluster)
        remote = ray.remote(FleetControl).options(name=name, num_cpus=0)
        self.control = remote.remote(self.plan.scalable_counts())
        ray.get(self.control.wanted_counts.remote())

    def wait_placed(self) -> dict[str, dict]:
        """``info()`` of every actor not yet placed; fails if Ray cannot place one in time."""
        import ray

        waiting = {
            name: h.info.remote() for name, h in self.actors.items() if name not in self.placed
        }
        if not waiting:
            return {}
        ready, _ = ray.wait(
            list(waiting.values()),
            num_returns=len(waiting),
            timeout=self.config.ray.start_timeout_s,
        )
        stuck = [name for name, ref in waiting.items() if ref not in ready]
        if stuck:
            raise PlacementError(self.placement_failure(stuck))
        nodes = {n["NodeID"]: sorted(n["Resources"]) for n in ray.nodes() if n["Alive"]}
        for name, ref in waiting.items():
            info = ray.get(ref)
            self.placed[name] = {**info, "node_resources": nodes.get(info["node_id"], [])}
        return {name: self.placed[name] for name in waiting}

    def placement_failure(self, stuck: list[str]) -> str:
        """Why ``stuck`` actors did not start: those whose demand no live node could ever
        hold are named apart from those that were only slow (a busy machine)."""
        import ray

        totals = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        wanted = {name: role_demand(self.config.ray, self.roles[name]) for name in stuck}
        unplaceable = [
            name for name in stuck if not any(fits(wanted[name], node) for node in totals)
        ]
        why = f"Ray did not place {stuck} within {self.config.ray.start_timeout_s:.0f} s"
        if unplaceable:
            asks = {name: demand(wanted[name]) for name in unplaceable}
            why += f"; no node can hold {unplaceable} (they ask for {asks})"
        return f"{why}: free resources {ray.available_resources()}"

    def record(self, http_port: int) -> None:
        """``endpoints.json`` (addresses, and how to reach this launcher) and the placement."""
        from rlfleet.common.endpoints import describe, write_endpoints
        from rlfleet.common.entry import safe_url

        run_dir = self.config.run_dir
        for name, info in self.placed.items():
            if addresses := self.endpoints_of(name, info["address"], http_port):
                write_endpoints(run_dir, name, addresses)
                key = " (open it with ?key=<api_key>)" if self.config.api_key else ""
                where = f"(node {info['node_ip']}){key if name == 'dashboard' else ''}"
                say(self.config, f"rlfleet up: {describe(name, addresses)} {where}")
        write_endpoints(run_dir, "redis", {"url": safe_url(self.launch.redis_url)})
        ray_entry = {
            "address": self.address,
            "namespace": self.config.ray.namespace,
            "control": control_name(self.config.cluster),
        }
        write_endpoints(run_dir, "ray", ray_entry)
        self.write_placement()

    def endpoints_of(self, name: str, address: str | None, http_port: int) -> dict[str, str]:
        """What ``endpoints.json`` says of actor ``name`` (nothing for one without a fixed
        address: a replica registers its own). The dashboard's page is on
        ``dashboard.host``, the address the dashboard itself records once it listens."""
        if not address:
            return {}
        host, port = address.rsplit(":", 1)
        if name == "dashboard":
            scheme = tls.scheme(self.config.tls)
            return {"http": f"{scheme}://{self.config.dashboard.host}:{port}/"}
        if name == "router":
            return {
                "grpc": address,
                "http": f"{tls.scheme(self.config.tls)}://{host}:{http_port}/v1",
            }
        return {"grpc": address}

    def write_placement(self) -> None:
        path = Path(self.config.run_dir) / PLACEMENT_FILE
        path.write_text(json.dumps(self.placed, indent=2, sort_keys=True) + "\n")

    def supervise(self) -> int:
        """Until the trainer is done (its exit code) or an actor is out of restarts (1).

        One round per ``POLL_S``: ``exit_code`` answers at once while a role runs, so
        unpaced rounds were a busy loop (measured: the driver at ~45% of a core and every
        actor at ~10%, taken from the roles on a 2-core machine)."""
        import ray

        while True:
            next_round = time.monotonic() + POLL_S
            for name, handle in self.actors.items():
                self.pending.setdefault(name, handle.exit_code.remote())
            refs = list(self.pending.values())
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=POLL_S)
            for name in [n for n, ref in self.pending.items() if ref in ready]:
                code = self.outcome(name, self.pending.pop(name))
                if code is not None:
                    return code
            self.follow_scale()
            time.sleep(max(0.0, next_round - time.monotonic()))

    def outcome(self, name: str, ref) -> int | None:
        """The launcher's exit code if actor ``name`` ended the run, else None."""
        import ray
        from ray.exceptions import RayActorError

        try:
            code = ray.get(ref)
        except RayActorError as exc:
            self.report_death(name, exc)
            return 1
        return code if name == "trainer" and code is not None else None

    def report_death(self, name: str, exc: Exception) -> None:
        log = Path(self.launch.log_dir) / f"{name}.log"
        lines = log.read_text(errors="replace").splitlines()[-10:] if log.is_file() else []
        tail = "\n".join(f"    {line}" for line in lines)
        print(
            f"\nrlfleet up: service '{name}' died and Ray will not restart it "
            f"(ray.max_restarts); stopping the fleet. {type(exc).__name__}. Last output:\n"
            f"{tail}\n(full log: {log})",
            file=sys.stderr,
        )

    def follow_scale(self) -> None:
        """Start or stop actors until each scalable role has what ``rlfleet scale`` asked for."""
        import ray

        for role, wanted in ray.get(self.control.wanted_counts.remote()).items():
            self.scale_role(role, wanted)

    def scale_role(self, role: str, wanted: int) -> None:
        """The newest members go first; the lowest (``rollout-0``, the env front) stay."""
        members = sorted((n for n in self.actors if self.roles[n] == role), key=member_index)
        if len(members) == wanted:
            return
        for _ in range(wanted - len(members)):
            free = next(i for i in itertools.count() if member_name(role, i) not in self.actors)
            self.start_actor(scaled_spec(role, free), self.launch)
        for name in members[wanted:]:
            self.stop_actors([name])
        what = "rollout replicas" if role == "rollout" else f"{role} processes"
        say(self.config, f"rlfleet up: {what} {len(members)} -> {wanted}")
        self.wait_placed()
        self.write_placement()

    def stop_actors(self, names: list[str]) -> None:
        """SIGTERM their roles (in parallel), wait, then kill the actors for good."""
        import ray

        handles = [self.actors.pop(name) for name in names]
        placed = [h for name, h in zip(names, handles, strict=True) if self.placed.pop(name, None)]
        for name in names:
            self.pending.pop(name, None)
        stops = [h.stop.remote() for h in placed]  # one never placed has no role to stop
        ray.wait(stops, num_returns=len(stops), timeout=STOP_GRACE_S + 5)
        for handle in handles:
            ray.kill(handle, no_restart=True)

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self.stop_actors(list(reversed(self.actors)))
        if self.control is not None:
            ray.kill(self.control, no_restart=True)
        for group in self.groups.values():
            remove_placement_group(group)


def launch_settings(config: RlfleetConfig, args, redis_url: str, host: str | None) -> Launch:
    """What every role shares. Paths are made absolute: a role may start in another folder."""
    run_dir = Path(config.run_dir).resolve()
    overrides, secrets = split_secrets(args.overrides)  # secrets travel in the environment
    common = (*overrides, f"run_dir={run_dir}")
    config_path = str(Path(args.config).resolve()) if args.config else None
    logs, cwd = str(run_dir / "logs"), str(Path.cwd())
    return Launch(config_path, common, redis_url, logs, cwd, host, secrets)


def run_on_ray(config: RlfleetConfig, args) -> int:
    """``rlfleet up --ray``'s whole life; returns its exit code (130 when interrupted)."""
    actors = plan_from_args(config, args).counts()
    cluster: Cluster | None = None
    fleet: RayFleet | None = None
    redis = None
    code = 1
    with ExitStack() as restore_signals:
        try:
            cluster = connect(config.ray, args.ray or None, local_cpus(config.ray, actors))
            # After Ray's start-up, which sets handlers of its own.
            restore_signals.enter_context(stop_on_signals())
            what = "started a local" if cluster.local else "joined the"
            say(config, f"rlfleet up: {what} Ray cluster at {cluster.address}")
            host = "127.0.0.1" if one_machine() else None
            if host is None and not config.redis_url:
                raise SystemExit(
                    "rlfleet up --ray: the cluster spans several machines; set "
                    "redis_url (RLFLEET_REDIS_URL) to a Redis every node reaches"
                )
            groups = reserve_pools(config.ray, config.cluster, config.ray.start_timeout_s)
            run_dir = Path(config.run_dir)
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            redis = start_redis(config, run_dir)
            redis_url = fleet_redis_url(config, redis)
            launch = launch_settings(config, args, redis_url, host)
            fleet = RayFleet(config, args, launch, groups, cluster.address)
            fleet.start()
            code = fleet.supervise()
            if code == 0 and not args.no_trainer:
                print_run_summary(run_dir / "summary.json")
            return code
        except PlacementError as exc:
            print(f"rlfleet up: {exc}; stopping the fleet", file=sys.stderr)
            return code
        except KeyboardInterrupt:
            print("\nrlfleet up: interrupted, stopping the fleet", file=sys.stderr)
            code = 130
            return code
        finally:
            shut_down(fleet, cluster, redis, keep_temp=code not in (0, 130))


def shut_down(fleet: RayFleet | None, cluster: Cluster | None, redis, keep_temp: bool) -> None:
    """Everything we started, in reverse; each step runs even if an earlier one failed."""
    try:
        if fleet is not None:
            fleet.stop()
    finally:
        try:
            if cluster is not None:
                cluster.shutdown(keep_temp=keep_temp)
                if keep_temp and cluster.temp_dir is not None:
                    print(f"rlfleet up: Ray's logs kept in {cluster.temp_dir}", file=sys.stderr)
        finally:
            if redis is not None:
                redis.stop()
