"""``rlfleet up``: the whole fleet as local processes.

Starts an embedded Redis (unless ``RLFLEET_REDIS_URL`` is set), the router, N rollout
replicas, reward, refcritic and the trainer; streams each one's output with a
``[name]`` prefix (and into ``run_dir/logs``); and leaves nothing behind: when the
trainer finishes, on Ctrl-C, or when any service dies (then it says which one and
why), every process it started is stopped, by its own process group.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.common.config import RlfleetConfig, load_config

STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    tail: list[str] = field(default_factory=list)

    def start(self, preexec_fn=None) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        """Copy output to our stdout with a prefix; keep the last lines for error reports."""
        prefix = f"[{self.name}] ".encode()
        with self.log_path.open("ab") as log:
            for piece in _pieces(self.proc.stdout):
                log.write(piece)
                log.flush()
                sys.stdout.buffer.write(prefix + piece)
                sys.stdout.buffer.flush()
                self.tail = (self.tail + [piece.decode(errors="replace").rstrip()])[-15:]

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # its own session: reaches vLLM's engine children
            except ProcessLookupError:
                pass


def _pieces(stream):
    """Lines split on \\n or \\r, so progress bars come through line by line."""
    buffer = b""
    while chunk := stream.read1(4096):
        buffer += chunk
        while (cut := _first_break(buffer)) >= 0:
            yield buffer[: cut + 1].replace(b"\r", b"\n")
            buffer = buffer[cut + 1 :]
    if buffer:
        yield buffer + b"\n"


def _first_break(buffer: bytes) -> int:
    hits = [i for i in (buffer.find(b"\n"), buffer.find(b"\r")) if i >= 0]
    return min(hits) if hits else -1


def free_port() -> int:
    from rlfleet.common.redis_server import free_port as pick

    return pick()


QUIET_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Every role's torch threads sleep instead of spinning while they wait for work. The fleet
runs several torch processes on few cores (trainer, replicas, refcritic); spinning OpenMP
workers of an idle role steal the cores a busy one needs. Measured on the 2-core machine with
the rest of the machine busy: an actor update of 256 sequences took 2.5 s with spinning
threads and 0.5 s with passive ones (0.3 s with one thread)."""


def role_argv(verb: str, config_path: str | None, overrides: list[str]) -> list[str]:
    """The command line that starts one role: ``rlfleet VERB [--config FILE] OVERRIDES``."""
    config_args = ["--config", config_path] if config_path else []
    return [sys.executable, "-m", "rlfleet.cli", verb, *config_args, *overrides]


def role_env(redis_url: str) -> dict[str, str]:
    """Every role's environment: ours, quiet OpenMP threads unless the user chose, Redis."""
    env = {**os.environ, **QUIET_THREADS, "PYTHONUNBUFFERED": "1", "RLFLEET_REDIS_URL": redis_url}
    env.update({k: v for k, v in os.environ.items() if k in QUIET_THREADS})  # the user's win
    return env


def plan_children(config: RlfleetConfig, args, redis_url: str, log_dir: Path) -> list[Child]:
    """Every process to start, in start order, with ports and endpoints filled in."""
    ports = {role: free_port() for role in ("router", "reward", "refcritic", "trainer")}
    common = [
        f"redis_url={redis_url}",
        f"endpoints.router=127.0.0.1:{ports['router']}",
        f"endpoints.reward=127.0.0.1:{ports['reward']}",
        f"endpoints.refcritic=127.0.0.1:{ports['refcritic']}",
        f"endpoints.trainer=127.0.0.1:{ports['trainer']}",
        *args.overrides,
    ]
    env = role_env(redis_url)

    def child(name, verb, *extra, env_extra=None):
        argv = role_argv(verb, args.config, [*common, *extra])
        return Child(name, argv, {**env, **(env_extra or {})}, log_dir / f"{name}.log")

    cores = os.cpu_count() or 1
    http_port = config.router.http_port or free_port()  # the OpenAI-compatible API
    print(f"rlfleet up: router HTTP at http://127.0.0.1:{http_port}/v1", flush=True)
    record_endpoints(config, args, ports, http_port, redis_url)
    children = [child("router", "router", f"router.port={ports['router']}",
                      f"router.http_port={http_port}")]  # fmt: skip
    children += [
        child(
            f"rollout-{i}",
            "rollout",
            f"rollout.replica_id=rollout-{i}",
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
    if not args.no_trainer:
        roles["trainer"] = {"grpc": f"127.0.0.1:{ports['trainer']}"}
    for role, addresses in roles.items():
        write_endpoints(config.run_dir, role, addresses)
        print(f"rlfleet up: {describe(role, addresses)}", flush=True)


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
        f"({attempt}/{limit}), the run goes on",
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


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="rlfleet up", description="Run the whole fleet (and the training job) locally."
    )
    parser.add_argument("--config", help="YAML config shared by every role")
    parser.add_argument("--rollout-replicas", type=int, default=2, help="replicas (default 2)")
    parser.add_argument("--no-trainer", action="store_true", help="serve only, until Ctrl-C")
    parser.add_argument(
        "--ray", nargs="?", const="", metavar="ADDRESS",
        help="run the roles as Ray actors, on the cluster at ADDRESS or a local one",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every role")
    args = parser.parse_args(argv)
    if args.ray and "=" in args.ray:  # `--ray a.b=c`: an override, not an address
        args.overrides, args.ray = [args.ray, *args.overrides], ""
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rollout_replicas < 1:
        raise SystemExit("rlfleet up: --rollout-replicas must be >= 1")
    config = load_config(args.config, args.overrides)
    if args.ray is not None or config.launcher == "ray":
        from rlfleet.ray_launcher.up import run_on_ray

        return run_on_ray(config, args)
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


def print_run_summary(path: Path) -> None:
    """The job's headline numbers, unprefixed, as the last lines ``rlfleet up`` prints."""
    import json

    if not path.is_file():
        return
    summary = json.loads(path.read_text())
    reached = summary.get("time_to_target_s")
    target = summary.get("target_accuracy", 0.85)
    before, after = summary.get("val_before", {}), summary.get("val_after", {})
    for name, value in after.items():
        start = f"{before[name]:.3f}" if name in before else "n/a"
        print(f"held-out {name}: {start} -> {value:.3f}")
    print(f"time_to_{target:g}_s: {'never' if reached is None else reached}")
    print(
        f"training_time_s: {summary.get('training_time_s')}  wall_time_s: {summary['wall_time_s']}"
    )


def start_redis(config: RlfleetConfig, run_dir: Path):
    """Embedded Valkey when no Redis URL is configured; None otherwise."""
    if config.redis_url:
        return None
    from rlfleet.common.redis_server import EmbeddedRedis

    server = EmbeddedRedis(run_dir / "redis")
    server.start()
    print(f"rlfleet up: embedded Redis at {server.url}", flush=True)
    return server


if __name__ == "__main__":
    sys.exit(main())
