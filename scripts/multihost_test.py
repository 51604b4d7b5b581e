#!/usr/bin/env python3
"""`make multihost-test`: the fleet on a Ray cluster of three hosts, then nothing left behind.

Hosts are network namespaces on one machine (scripts/netns_hosts.py): ``rlmh-0`` (the head,
198.51.100.10), ``rlmh-1`` and ``rlmh-2`` (workers, .11 and .12), each reaching the others
only by address across a bridge. In order:

1. hosts: ``netns_hosts.py up --hosts 3``;
2. Redis on the head host, bound to its address (the roles on the workers must reach it);
3. Ray: ``ray start --head --node-ip-address 198.51.100.10`` with the label ``rlfleet_head``,
   and ``ray start --address 198.51.100.10:PORT --node-ip-address ...`` on each worker with
   ``rlfleet_worker`` and one CPU (so the two replicas land one per worker);
4. ``rlfleet up --ray 198.51.100.10:PORT`` on the head, the tiny policy with the transformers
   engine for a few GRPO steps, placed by the labels as ``rlfleet slurm`` places them
   (``slurm_plan.placement_overrides``: the trainer and the servers on the head, replicas on
   the workers);
5. checks: exit 0 and every step done; where Ray put each role; that each replica served from
   its worker's address; that the trainer streamed the weights to both (they share this
   machine's ``/dev/shm`` and hostname, but not its addresses: ``rlfleet.common.host_address``)
   and wrote no shared-memory payload;
6. teardown, always: every process in our namespaces ends (``netns_hosts.py down``), then
   nothing may remain: no namespace, veth, bridge, FORWARD rule, nor a process naming our Ray
   folder or run directory.

Optional faults after the first step, on the host of ``rollout-1`` (the run must still
finish): ``--lose-host`` SIGKILLs all its processes and deletes it; ``--cut-link 10`` sets
the bridge side of its veth down for 10 s, then up. Prints PASS/FAIL with per-phase timings.
Needs root (namespaces); exits 77 (skipped) where namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import netns_hosts as nh  # noqa: E402

PREFIX = "rlmh"
HEAD, WORKERS = f"{PREFIX}-0", [f"{PREFIX}-1", f"{PREFIX}-2"]
HEAD_IP, WORKER_IPS = "198.51.100.10", ["198.51.100.11", "198.51.100.12"]
RAY_PORT, REDIS_PORT = 6380, 6390
QUIET = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
SMALL_JOB = [
    "rollout.backend=hf",
    "data.val_size=8",
    "data.train_batch_size=4",
    "rollout.n=4",
    "trainer.replica_wait_s=300",
    "dashboard.enabled=false",
    "ray.start_timeout_s=600",  # a Ray worker process may take minutes to start on a busy box
]
SKIPPED = 77
REPLICAS = ("rollout-0", "rollout-1")


class Failed(Exception):
    pass


def log(message: str) -> None:
    print(f"[multihost] {message}", flush=True)


class Run:
    """One test run: its folders, the processes it started, and its timings."""

    def __init__(self, args) -> None:
        self.args = args
        self.temp = Path(tempfile.mkdtemp(prefix="rlmh-", dir="/tmp"))  # Ray: short socket paths
        self.run_dir = self.temp / "run"
        self.logs = self.temp / "logs"
        self.logs.mkdir(parents=True)
        self.procs: list[subprocess.Popen] = []
        self.timings: dict[str, float] = {}
        self.python = str(Path(args.venv) / "bin" / "python")
        self.bin = Path(args.venv) / "bin"
        self.lost: str | None = None

    def phase(self, name: str, fn, *a):
        started = time.monotonic()
        try:
            return fn(*a)
        finally:
            self.timings[name] = round(time.monotonic() - started, 1)
            log(f"phase {name}: {self.timings[name]} s")

    def spawn(self, host: str, argv: list[str], name: str, env: dict | None = None):
        """``argv`` in namespace ``host``, logging to ``logs/NAME.log``."""
        out = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        full = ["ip", "netns", "exec", host, "env", *(f"{k}={v}" for k, v in (env or {}).items())]
        proc = subprocess.Popen([*full, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def wait_line(self, name: str, pattern: str, timeout_s: float) -> str:
        path, deadline = self.logs / f"{name}.log", time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace") if path.exists() else ""
            if re.search(pattern, text):
                return text
            time.sleep(0.5)
        raise Failed(f"{name}: no {pattern!r} within {timeout_s:.0f} s; log {path}")


# ---- phases ------------------------------------------------------------------------------


def make_hosts(run: Run) -> None:
    made = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "netns_hosts.py"), "up", "--prefix", PREFIX]
        + ["--hosts", "3"],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        raise Failed(f"netns_hosts up failed: {made.stderr.strip()}")


def start_redis(run: Run) -> str:
    from rlfleet.common.redis_server import find_server_binary

    conf = run.temp / "redis.conf"
    password = os.urandom(12).hex()
    conf.write_text(
        f'bind {HEAD_IP}\nport {REDIS_PORT}\nprotected-mode no\nsave ""\n'
        f"appendonly no\ndir {run.temp}\nrequirepass {password}\n"
    )
    conf.chmod(0o600)
    run.spawn(HEAD, [find_server_binary(), str(conf)], "redis")
    run.wait_line("redis", r"Ready to accept connections", 30)
    return f"redis://:{password}@{HEAD_IP}:{REDIS_PORT}/0"


def start_ray(run: Run) -> str:
    ray = str(run.bin / "ray")
    common = ["--block", "--object-store-memory", str(100 * 1024 * 1024)]
    head = [ray, "start", "--head", "--node-ip-address", HEAD_IP, "--port", str(RAY_PORT)]
    head += ["--num-cpus", "4", "--resources", json.dumps({"rlfleet_head": 1000})]
    head += ["--include-dashboard", "false", "--disable-usage-stats"]
    run.spawn(HEAD, [*head, "--temp-dir", str(run.temp / "ray"), *common], "ray-head", QUIET)
    run.wait_line("ray-head", "Ray runtime started", 240)
    address = f"{HEAD_IP}:{RAY_PORT}"
    cpus = "2" if run.args.lose_host else "1"
    for i, (host, ip) in enumerate(zip(WORKERS, WORKER_IPS, strict=True)):
        node = [ray, "start", "--address", address, "--node-ip-address", ip, "--num-cpus", cpus]
        node += ["--resources", json.dumps({"rlfleet_worker": 1000})]
        run.spawn(host, [*node, "--temp-dir", str(run.temp / f"ray{i + 1}"), *common], host, QUIET)
    for host in WORKERS:
        run.wait_line(host, "Ray runtime started", 240)
    return address


def fleet_argv(run: Run, address: str) -> list[str]:
    from rlfleet.common.config import load_config
    from rlfleet.launch.plan import plan_fleet
    from rlfleet.launch.slurm_plan import placement_overrides

    config_path = str(ROOT / "configs" / "default.yaml")
    overrides = [
        f"run_dir={run.run_dir}",
        f"cluster=mh{os.getpid()}",
        f"trainer.total_steps={run.args.steps}",
        *SMALL_JOB,
    ]
    config = load_config(config_path, overrides)
    placement = placement_overrides(config, plan_fleet(config, 2), nodes=3)
    up = [str(run.bin / "rlfleet"), "up", "--ray", address, "--config", config_path]
    return [*up, "--rollout-replicas", "2", *overrides, *placement]


def run_fleet(run: Run, address: str, redis_url: str) -> subprocess.CompletedProcess:
    env = {**QUIET, "RLFLEET_REDIS_URL": redis_url}
    proc = run.spawn(HEAD, fleet_argv(run, address), "fleet", env)
    if run.args.lose_host or run.args.cut_link:
        fault_after_first_step(run, proc)
    try:
        code = proc.wait(timeout=run.args.timeout)
    except subprocess.TimeoutExpired as exc:
        raise Failed(f"the fleet did not finish within {run.args.timeout} s") from exc
    return subprocess.CompletedProcess(proc.args, code)


def fault_after_first_step(run: Run, fleet: subprocess.Popen) -> None:
    """Once step 1 is done, the worker host running ``rollout-1``: lost whole (all its
    processes SIGKILLed, its namespace deleted), or its link cut for ``--cut-link`` seconds.
    Nothing when the fleet ended before its first step (its exit code tells why)."""
    deadline = time.monotonic() + run.args.timeout
    while not steps_done(run.run_dir) and time.monotonic() < deadline:
        if fleet.poll() is not None:
            raise Failed(f"the fleet exited {fleet.returncode} before its first step")
        time.sleep(0.2)
    placed = json.loads((run.run_dir / "ray_placement.json").read_text())
    victim = WORKERS[WORKER_IPS.index(placed["rollout-1"]["node_ip"])]
    script = [sys.executable, str(Path(nh.__file__))]
    after = f"after step {steps_done(run.run_dir)[-1]}"
    if run.args.lose_host:
        log(f"losing host {victim} (rollout-1) {after}")
        subprocess.run([*script, "lose", victim], check=True)
        run.lost = victim
        return
    log(f"cutting the link of {victim} (rollout-1) for {run.args.cut_link:.0f} s {after}")
    subprocess.run([*script, "link", victim, "down"], check=True)
    time.sleep(run.args.cut_link)
    subprocess.run([*script, "link", victim, "up"], check=True)
    log(f"link of {victim} restored at step {steps_done(run.run_dir)[-1:]}")


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [m["step"] for m in map(json.loads, lines) if "timing_s/step" in m]


# ---- checks ------------------------------------------------------------------------------


def check_run(run: Run, result: subprocess.CompletedProcess) -> list[str]:
    """What went wrong, as sentences (empty: passed)."""
    problems = []
    fleet_log = (run.logs / "fleet.log").read_text(errors="replace")
    if result.returncode != 0:
        problems.append(f"rlfleet up exited {result.returncode}: {fleet_log[-3000:]}")
    if steps_done(run.run_dir) != list(range(1, run.args.steps + 1)):
        problems.append(f"steps done {steps_done(run.run_dir)}, wanted 1..{run.args.steps}")
    placement_file = run.run_dir / "ray_placement.json"
    placed = json.loads(placement_file.read_text()) if placement_file.exists() else {}
    for name in ("router", "reward", "trainer"):
        if placed.get(name, {}).get("node_ip") != HEAD_IP:
            problems.append(f"{name} not on the head: {placed.get(name)}")
    for name in REPLICAS:
        started = re.findall(rf"\[ray\] {name} started on node (\S+)", fleet_log)
        if not started or started[0] not in WORKER_IPS:
            problems.append(f"{name} did not start on a worker host: {started}")
    first = [re.findall(rf"\[ray\] {n} started on node (\S+)", fleet_log)[:1] for n in REPLICAS]
    if first[0] == first[1]:
        problems.append(f"both replicas started on one host: {first[0]}")
    problems += check_weights_streamed(run)
    return problems


def check_weights_streamed(run: Run) -> list[str]:
    trainer_log = run.run_dir / "logs" / "trainer.log"
    text = trainer_log.read_text(errors="replace") if trainer_log.exists() else ""
    streamed = set(re.findall(r"replica at (\S+?):\d+ is not on this host", text))
    problems = []
    if not set(WORKER_IPS) <= streamed:
        problems.append(f"the trainer streamed to {sorted(streamed)}, wanted both workers")
    if "cannot read shared memory" in text:
        problems.append("the trainer first offered a replica shared memory (by hostname?)")
    return problems


# ---- teardown ----------------------------------------------------------------------------


def teardown(run: Run) -> list[str]:
    """Everything ours ends; what is left over, as sentences."""
    down = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "netns_hosts.py"), "down", "--prefix", PREFIX],
        capture_output=True,
        text=True,
    )
    for proc in run.procs:  # `ip netns exec` wrappers whose children `down` ended
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    left = [f"netns_hosts down: {down.stderr.strip()}"] if down.returncode else []
    left += [f"namespace {n}" for n in nh.our_namespaces(PREFIX)]
    left += [f"link {n}" for n in nh.our_links(PREFIX)]
    left += ["bridge"] * nh.has_bridge(PREFIX) + ["FORWARD rule"] * nh.our_rules(PREFIX)
    left += [f"process {pid}" for pid in processes_naming(str(run.temp))]
    return left


def processes_naming(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the fleet on three network-namespace hosts")
    parser.add_argument("--venv", default=str(ROOT / ".venv"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--lose-host", action="store_true", help="lose rollout-1's host")
    parser.add_argument("--cut-link", type=float, default=0.0, help="cut its link N seconds")
    parser.add_argument("--keep", action="store_true", help="keep logs and the run directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    why = nh.cannot_make_namespaces()
    if why:
        log(f"SKIPPED: {why}")
        return SKIPPED
    run = Run(args)
    problems: list[str] = []
    try:
        run.phase("hosts", make_hosts, run)
        redis_url = run.phase("redis", start_redis, run)
        address = run.phase("ray", start_ray, run)
        result = run.phase("fleet", run_fleet, run, address, redis_url)
        problems += check_run(run, result)
    except Failed as exc:
        problems.append(str(exc))
    finally:
        left = run.phase("teardown", teardown, run)
        problems += [f"left behind: {item}" for item in left]
        log(f"timings (s): {json.dumps(run.timings)}; logs in {run.logs}")
    for problem in problems:
        log(f"problem: {problem}")
    log("PASS" if not problems else "FAIL")
    if not problems and not args.keep:
        shutil.rmtree(run.temp, ignore_errors=True)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
