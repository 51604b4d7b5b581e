"""``rlfleet up``: the whole fleet as local processes.

Starts the router, N rollout replicas, reward, refcritic and the trainer (after the embedded
Redis, ``rlfleet.launch.session``); streams each one's output with a ``[name]`` prefix (and
into ``run_dir/logs``); and leaves nothing behind: when the trainer finishes, on Ctrl-C, or
when any service dies (then it says which one and why), every process it started is stopped,
by its own process group.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.pdeathsig import die_with_parent
from rlfleet.launch.process import Child, free_port, role_argv, role_env, split_secrets
from rlfleet.launch.session import print_run_summary, say, start_redis

STOP_GRACE_S = 10.0


def plan_children(config: RlfleetConfig, args, redis_url: str, log_dir: Path) -> list[Child]:
    """Every process to start, in start order, with ports and endpoints filled in."""
    ports = {role: free_port() for role in ("router", "reward", "refcritic", "trainer", "env")}
    overrides, secrets = split_secrets(args.overrides)  # secrets travel in the environment
    common = [
        f"endpoints.router=127.0.0.1:{ports['router']}",
        f"endpoints.reward=127.0.0.1:{ports['reward']}",
        f"endpoints.refcritic=127.0.0.1:{ports['refcritic']}",
        f"endpoints.trainer=127.0.0.1:{ports['trainer']}",
        f"agent.address=127.0.0.1:{ports['env']}",
        *overrides,
    ]
    env = role_env(redis_url, secrets)  # Redis too: its URL may hold a password
    # Every role gets SIGTERM if `rlfleet up` dies outright (SIGKILL): no fleet left running
    # on its own. Children are started and restarted from the main thread, the signal's anchor.
    die_with_us, _ = die_with_parent(signal.SIGTERM)

    def child(name, verb, *extra, env_extra=None, flags=()):
        argv = [*die_with_us, *role_argv(verb, args.config, [*common, *extra], flags)]
        return Child(name, argv, {**env, **(env_extra or {})}, log_dir / f"{name}.log")

    cores = os.cpu_count() or 1
    http_port = config.router.http_port or free_port()  # the OpenAI-compatible API
    say(config, f"rlfleet up: router HTTP at http://127.0.0.1:{http_port}/v1")
    record_endpoints(config, args, ports, http_port, redis_url)
    dashboard, replica_metrics = dashboard_ports(config, args.rollout_replicas)
    children = [child("router", "router", f"router.port={ports['router']}",
                      f"router.http_port={http_port}")]  # fmt: skip
    if dashboard is not None:  # the live page (rlfleet.dashboard), up while replicas load
        children.append(child("dashboard", "dashboard", f"dashboard.port={dashboard}"))
    children += [
        child(
            f"rollout-{i}",
            "rollout",
            f"rollout.replica_id=rollout-{i}",
            *([f"rollout.metrics_port={replica_metrics[i]}"] if replica_metrics else []),
            env_extra={
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
                    "VLLM_CPU_OMP_THREADS_BIND", str(i % cores)
                )
            },
        )
        for i in range(args.rollout_replicas)
    ]
    children.append(child("reward", "reward", f"reward.port={ports['reward']}"))
    if config.needs_refcritic:
        children.append(child("refcritic", "refcritic", f"refcritic.port={ports['refcritic']}"))
    if config.agent.env:  # agent mode: episodes run in the env role, apart from the trainer
        gateway = [] if config.agent.gateway_url else [  # workflows' and verifiers' OpenAI base
            f"agent.gateway_url=http://127.0.0.1:{http_port}/v1"]  # fmt: skip
        children.append(child("env", "env", f"agent.port={ports['env']}", *gateway))
        children += [child(f"env-{i}", "env", *gateway, flags=("--worker-only",))
                     for i in range(1, args.env_processes)]  # fmt: skip
    if not args.no_trainer:
        children.append(
            child(
                "trainer",
                "trainer",
                f"trainer.port={ports['trainer']}",
                f"trainer.min_replicas={args.rollout_replicas}",
            )
        )
    return children


def record_endpoints(config, args, ports: dict, http_port: int, redis_url: str) -> None:
    """Every role's address in ``run_dir/endpoints.json`` (services add what they bind)."""
    from rlfleet.common.endpoints import describe, write_endpoints
    from rlfleet.common.entry import safe_url

    roles = {"redis": {"url": safe_url(redis_url)},
             "router": {"grpc": f"127.0.0.1:{ports['router']}",
                        "http": f"http://127.0.0.1:{http_port}/v1"},
             "reward": {"grpc": f"127.0.0.1:{ports['reward']}"}}  # fmt: skip
    if config.needs_refcritic:
        roles["refcritic"] = {"grpc": f"127.0.0.1:{ports['refcritic']}"}
    if config.agent.env:
        roles["env"] = {"grpc": f"127.0.0.1:{ports['env']}"}
    if not args.no_trainer:
        roles["trainer"] = {"grpc": f"127.0.0.1:{ports['trainer']}"}
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
    for i, metrics_port in enumerate(metrics):
        url = f"http://{config.rollout.host}:{metrics_port}/metrics"
        write_endpoints(config.run_dir, f"rollout-{i}", {"metrics": url})
    write_endpoints(config.run_dir, "dashboard", {"http": f"http://{host}:{port}/"})
    key = " (open it with ?key=<api_key>)" if config.api_key else ""
    say(config, f"rlfleet up: dashboard at http://{host}:{port}/{key}")
    return port, metrics


def stop_all(children: list[Child]) -> None:
    for child in reversed(children):
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        while child.exited() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        child.signal(signal.SIGKILL)
        if child.proc is not None:
            child.proc.wait()


def supervise(children: list[Child], replica_restarts: int = 0) -> int:
    """Wait for the trainer (or any failure); return the exit code for ``rlfleet up``.

    Rollout replicas are expendable: one that dies is started again (same replica id) up to
    ``replica_restarts`` times each while the run goes on; any other service's exit stops
    the fleet."""
    trainer = next((c for c in children if c.name == "trainer"), None)
    restarts: dict[str, int] = {}
    while True:
        if trainer is not None and (code := trainer.exited()) is not None:
            if code:
                report_failure(trainer, code)
            return code
        for child in children:
            code = child.exited()
            if child is trainer or code is None:
                continue
            if is_replica(child) and code == 0:  # drained (DrainReplica): it is done
                print(f"rlfleet up: replica '{child.name}' was drained and exited",
                      file=sys.stderr, flush=True)  # fmt: skip
                children.remove(child)
                break
            if is_replica(child) and restarts.get(child.name, 0) < replica_restarts:
                restarts[child.name] = restarts.get(child.name, 0) + 1
                restart_replica(child, code, restarts[child.name], replica_restarts)
                continue
            report_failure(child, code)
            return 1
        time.sleep(0.2)


def is_replica(child: Child) -> bool:
    return child.name.startswith("rollout-")


def restart_replica(child: Child, code: int, attempt: int, limit: int) -> None:
    print(
        f"rlfleet up: replica '{child.name}' exited with code {code}; restarting it "
        f"({attempt}/{limit}), the run goes on (its log: {child.log_path})",
        file=sys.stderr,
        flush=True,
    )
    try:  # what is left of its process group (vLLM's engine core) goes with it
        os.killpg(child.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.start()


def report_failure(child: Child, code: int) -> None:
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
    children: list[Child] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        children = plan_children(config, args, redis.url if redis else config.redis_url, log_dir)
        for child in children:
            child.start()
        code = supervise(children, config.rollout.max_restarts)
        if code == 0 and not args.no_trainer:
            print_run_summary(run_dir / "summary.json")
        return code
    except KeyboardInterrupt:
        print("\nrlfleet up: interrupted, stopping the fleet", file=sys.stderr)
        return 130
    finally:
        stop_all(children)
        if redis is not None:
            redis.stop()
        signal.signal(signal.SIGTERM, previous)
