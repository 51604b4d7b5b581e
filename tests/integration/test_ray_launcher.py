"""`rlfleet up --ray` on real Ray clusters on this machine.

First, the launcher's own local cluster (no address), once: the done-when run trains 5 steps
and leaves no Ray process behind. Then one module-scoped cluster of two node processes (`ray
start --head`, and a second node with one CPU and the custom resource `node2`), joined with
`--ray ADDRESS` (cheaper than a cluster per test): a role Ray cannot place fails its run
cleanly; the agent job runs its env role; then one fleet: the reward is pinned to node2 by
its resource, router and trainer share a pool (a placement group, STRICT_PACK); the dashboard
is one more actor and sees the fleet; a replica actor killed with SIGKILL is restarted by
Ray, registers again and serves the trainer's current weights; `rlfleet scale` adds and
removes a replica; Ctrl-C stops every actor and role.
Each node has its own session folder: two nodes sharing one would forward every line twice.

Leftovers are checked by what is ours only: processes whose command line names our run
directory or our Ray session folder, or that hold a file open in that folder (Ray's workers
rename themselves ``ray::...`` but keep their logs open there). Only those are ever killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from procs import ServiceProcess, clean_env

from rlfleet.common.redis_server import free_port
from rlfleet.rollout.client import RolloutClient

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE = str(100 * 1024 * 1024)
CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
"""For the test's own loopback cluster: `ray start --address` does not pick up the token that
`ray start --head` found in ~/.ray, so tokens are off on both nodes and for its drivers."""
SMALL_JOB = [
    "rollout.backend=hf",
    "data.val_size=8",
    "data.train_batch_size=2",
    "rollout.n=4",
    "trainer.replica_wait_s=400",
]

pytestmark = pytest.mark.slow


# ---- whose processes ---------------------------------------------------------------------


def processes_using(marker: str) -> list[int]:
    """PIDs (not ours) whose command line contains ``marker`` or that hold a file under it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace") or any(
                os.readlink(fd).startswith(marker) for fd in (entry / "fd").iterdir()
            ):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not readable
            continue
    return found


def wait_gone(marker: str, timeout_s: float = 60) -> list[int]:
    """Until nothing uses ``marker`` (returns []), or what is still there at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_using(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def short_temp_dir() -> str:
    """Ray puts Unix sockets in its session folder: keep the path short (107-byte limit)."""
    return tempfile.mkdtemp(prefix="rlft-", dir="/tmp")


def up_argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "up",
        *extra,
        f"run_dir={run_dir}",
        f"cluster=ray{uuid.uuid4().hex[:8]}",
        *SMALL_JOB,
    ]


def steps_done(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [m["step"] for m in map(json.loads, lines) if "timing_s/step" in m]


# ---- the launcher's own local cluster -----------------------------------------------------


def test_done_when_five_steps_on_a_local_cluster_and_nothing_left(tmp_path):
    """`rlfleet up --ray --config configs/default.yaml trainer.total_steps=5` with no cluster
    running: trains 5 steps, then no Ray process and no role process is left."""
    run_dir, temp_dir = tmp_path / "run", short_temp_dir()
    argv = up_argv(
        run_dir,
        "--ray",
        "--config",
        str(ROOT / "configs" / "default.yaml"),
        "--rollout-replicas",
        "1",
    )
    argv += ["trainer.total_steps=5", f"ray.temp_dir={temp_dir}"]
    try:
        result = subprocess.run(
            argv, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=500
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        assert steps_done(run_dir) == [1, 2, 3, 4, 5]
        assert "started a local Ray cluster" in result.stdout
        assert wait_gone(temp_dir) == [] and wait_gone(str(run_dir)) == []
    finally:
        kill_all(temp_dir)
        kill_all(str(run_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


def kill_all(marker: str) -> None:
    """SIGKILL what is left of a test's own Ray session (found by its folder only)."""
    for pid in processes_using(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- a two-node cluster started by the test ------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head` and a second node (`--num-cpus 1 --resources {"node2": 1}`) as our
    own processes; their address. Stopped by SIGKILL, then everything left in our session
    folder is killed by PID."""
    logs, temp_dir = tmp_path_factory.mktemp("ray-nodes"), short_temp_dir()
    env = clean_env(**CLUSTER_ENV)
    common = ["--block", "--object-store-memory", OBJECT_STORE]
    head_argv = [
        RAY,
        "start",
        "--head",
        "--port",
        str(free_port()),
        "--num-cpus",
        "6",
        "--include-dashboard",
        "false",
        "--disable-usage-stats",
        "--temp-dir",
        temp_dir,
        *common,
    ]
    nodes = [ServiceProcess.start(head_argv, logs / "head.log", "ray head", env)]
    try:
        nodes[0].wait_for_line("Ray runtime started", 180)
        address = re.search(r"--address='([^']+)'", nodes[0].log()).group(1)
        node2 = [
            RAY,
            "start",
            "--address",
            address,
            "--num-cpus",
            "1",
            "--resources",
            '{"node2": 1}',
            "--temp-dir",
            f"{temp_dir}/node2",
            *common,
        ]
        nodes.append(ServiceProcess.start(node2, logs / "node2.log", "ray node2", env))
        nodes[1].wait_for_line("Ray runtime started", 180)
        yield address
    finally:
        for node in reversed(nodes):
            node.stop(signal.SIGKILL)
        kill_all(temp_dir)
        assert wait_gone(temp_dir, 30) == []
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_a_role_ray_cannot_place_fails_the_run_and_leaves_nothing(ray_cluster, tmp_path):
    """On the module's cluster (joined, not started): a role no node can hold fails the run
    (exit 1, named), and every actor and role process of that fleet is gone afterwards."""
    run_dir = tmp_path / "run"
    argv = up_argv(
        run_dir,
        "--ray",
        ray_cluster,
        "--rollout-replicas",
        "1",
        "ray.roles={reward: {resources: {no_such_resource: 1}}}",
        "ray.start_timeout_s=5",
    )
    try:
        result = subprocess.run(
            argv,
            cwd=ROOT,
            env=clean_env(**CLUSTER_ENV),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
        # Only the reward actor can never be placed; on a busy machine others may also be slow.
        assert "no node can hold ['reward']" in result.stderr, result.stderr[-3000:]
        assert wait_gone(str(run_dir)) == []
    finally:
        kill_all(str(run_dir))


def test_agent_job_runs_the_env_role_and_keeps_secrets_off_command_lines(ray_cluster, tmp_path):
    """`rlfleet up --ray ADDRESS --config configs/agent_calc.yaml --env-processes 2 api_key=...`
    on the module's cluster:
    the env front door and a worker-only env process both play episodes for 2 multi-turn
    steps; no process but the launcher (given it on its own command line) has the API key on
    its command line (it travels in the roles' environment, and every server requires it: the
    run could not finish otherwise)."""
    run_dir, key = tmp_path / "run", f"sk-{uuid.uuid4().hex[:12]}"
    argv = up_argv(
        run_dir,
        "--ray",
        ray_cluster,
        "--config",
        str(ROOT / "configs" / "agent_calc.yaml"),
        "--rollout-replicas",
        "1",
        "--env-processes",
        "2",
        "trainer.total_steps=2",
        "data.train_batch_size=4",
        "rollout.n=4",
        "data.val_size=8",
        "trainer.ppo_mini_batch_size=16",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        f"api_key={key}",
    )
    env = clean_env(**CLUSTER_ENV)
    up = ServiceProcess.start(argv, tmp_path / "up.log", "rlfleet up --ray", env)
    lines: dict[int, str] = {}
    try:
        while up.poll() is None:
            for pid in processes_using(str(run_dir)):
                with contextlib.suppress(OSError):
                    lines.setdefault(pid, Path(f"/proc/{pid}/cmdline").read_bytes().decode())
            time.sleep(0.5)
        assert up.returncode == 0, up.log_tail(60)
        roles = [line.split("\0") for line in lines.values() if "rlfleet.cli\0" in line]
        assert ["env", "--config"] in [r[r.index("rlfleet.cli") + 1 :][:2] for r in roles]
        envs = [r for r in roles if r[r.index("rlfleet.cli") + 1] == "env"]
        assert len(envs) == 2 and any("--worker-only" in r for r in envs)  # env and env-1
        assert all(any(a.startswith("agent.gateway_url=http://") for a in r) for r in envs)
        assert not [line for pid, line in lines.items() if key in line and pid != up.pid]
        turns = [
            m["agent/turns/mean"]
            for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "agent/turns/mean" in m
        ]
        assert len(turns) == 2 and min(turns) > 1
        played = re.findall(r"\[(env(?:-1)?)\].*env workers stopped after (\d+) episodes", up.log())
        assert {name for name, count in played if int(count) > 0} == {"env", "env-1"}, played
        assert wait_gone(str(run_dir)) == []
    finally:
        up.stop(signal.SIGKILL)
        kill_all(str(run_dir))


@pytest.fixture(scope="module")
def fleet(ray_cluster, tmp_path_factory):
    """One `rlfleet up --ray ADDRESS` with 2 replicas, training (sync) until interrupted."""
    run_dir = tmp_path_factory.mktemp("ray-fleet") / "run"
    argv = up_argv(
        run_dir,
        "--ray",
        ray_cluster,
        "--rollout-replicas",
        "2",
        "trainer.mode=sync",
        "trainer.total_steps=100000",
        "trainer.use_kl_loss=false",
        "trainer.torch_threads=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "ray.max_restarts=2",
        "trainer.save_freq=2",
        "ray.pools={main: {bundles: [{CPU: 2}], strategy: STRICT_PACK}}",
        "ray.roles={reward: {resources: {node2: 1}}, router: {pool: main}, trainer: {pool: main}}",
    )
    env = clean_env(RLFLEET_RUN_DIR=str(run_dir), **CLUSTER_ENV)
    up = ServiceProcess.start(argv, run_dir.parent / "up.log", "rlfleet up --ray", env)
    try:
        up.wait_until(lambda: steps_done(run_dir), 400, "training")
        yield up, run_dir
    finally:
        up.stop(signal.SIGKILL)
        kill_all(str(run_dir))  # the embedded Redis, were the launcher killed before its cleanup


def placement(run_dir: Path) -> dict:
    return json.loads((run_dir / "ray_placement.json").read_text())


def replicas(run_dir: Path) -> dict[str, tuple[str, int]]:
    """replica id -> (state, weight version), as the router sees them."""
    address = json.loads((run_dir / "endpoints.json").read_text())["router"]["grpc"]

    async def ask():
        client = RolloutClient(address)
        try:
            return await client.list_replicas()
        finally:
            await client.close()

    try:
        found = asyncio.run(ask())
    except Exception:  # the router busy or restarting: ask again
        return {}
    return {r.replica_id: (str(r.state.value), r.weight_version) for r in found}


def serving_current(run_dir: Path, name: str, at_least: int) -> bool:
    """``name`` serves, with the version every other serving replica has, >= ``at_least``."""
    seen = replicas(run_dir)
    if seen.get(name, ("", 0))[0] != "serving":
        return False
    versions = {version for state, version in seen.values() if state == "serving"}
    return len(versions) == 1 and seen[name][1] >= at_least


def test_roles_are_placed_by_custom_resource_and_pool(fleet):
    _, run_dir = fleet
    placed = placement(run_dir)
    assert "node2" in placed["reward"]["node_resources"]
    assert placed["router"]["node_id"] == placed["trainer"]["node_id"]  # one STRICT_PACK pool
    assert "node2" not in placed["router"]["node_resources"]
    assert {"router", "reward", "trainer", "rollout-0", "rollout-1"} <= set(placed)


def test_the_dashboard_runs_as_an_actor_and_sees_the_ray_fleet(fleet):
    """`dashboard.enabled` (the default): one more role actor, its page recorded as the
    `dashboard` entry of endpoints.json and printed with the other endpoints; `/healthz`
    answers, and `/api/state` shows the fleet's replicas, and its router, reward and trainer
    up (the launcher gave it their addresses on the cluster)."""
    up, run_dir = fleet
    url = json.loads((run_dir / "endpoints.json").read_text())["dashboard"]["http"]
    assert f"dashboard: http={url}" in up.log()
    assert "dashboard" in placement(run_dir)
    assert http_json(url + "healthz") == (200, {"ok": True})
    state = up.wait_until(lambda: fleet_seen(url), 120, "the dashboard seeing the fleet")
    assert {"rollout-0", "rollout-1"} <= {r["replica_id"] for r in state["fleet"]["replicas"]}


def http_json(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status, json.loads(reply.read())


def fleet_seen(url: str) -> dict | None:
    """The dashboard's state once it shows router, reward and trainer up and two replicas."""
    status, state = http_json(url + "api/state")
    fleet = state.get("fleet", {}) if status == 200 else {}
    roles = {role["name"]: role["up"] for role in fleet.get("roles", [])}
    up = all(roles.get(name) for name in ("router", "reward", "trainer"))
    return state if up and fleet["trainer"].get("up") and len(fleet["replicas"]) >= 2 else None


def test_killed_replica_restarts_and_a_scaled_one_joins_both_on_current_weights(fleet):
    """SIGKILL to replica rollout-0's actor, and `rlfleet scale rollout=3` at the same time (so
    the two replica start-ups overlap): Ray restarts rollout-0 (its old role process dies with
    its actor), it registers again under its id; rollout-2 joins; the trainer brings both to
    its current weights and trains on. Then `rlfleet scale rollout=2` removes rollout-2."""
    up, run_dir = fleet
    before = placement(run_dir)["rollout-0"]
    version = replicas(run_dir)["rollout-1"][1]
    os.kill(before["actor_pid"], signal.SIGKILL)
    assert "rollout: 2 -> 3" in scale(run_dir, 3)
    up.wait_until(lambda: not alive(before["role_pid"]), 60, "the old role process gone")
    up.wait_for_line("rollout-0 restarted", 240)
    for name in ("rollout-0", "rollout-2"):
        up.wait_until(
            lambda n=name: serving_current(run_dir, n, version + 1),
            400,
            f"{name} serving the current weights",
        )
    trained = steps_done(run_dir)[-1]
    up.wait_until(lambda: steps_done(run_dir)[-1] > trained, 120, "training on")
    assert "rollout: 3 -> 2" in scale(run_dir, 2)
    up.wait_until(lambda: "rollout-2" not in replicas(run_dir), 120, "rollout-2 gone")


def test_killed_trainer_actor_resumes_from_its_newest_checkpoint(fleet):
    """SIGKILL to the trainer's actor: Ray restarts it, the trainer resumes from its newest
    `global_step_N` checkpoint (`resume_mode: auto`), pushes weights newer than any replica
    holds, and trains step N + 1 onwards again."""
    up, run_dir = fleet
    up.wait_until(lambda: newest_checkpoint(run_dir) >= 2, 240, "a step checkpoint")
    before = placement(run_dir)["trainer"]
    os.kill(before["actor_pid"], signal.SIGKILL)
    up.wait_until(lambda: not alive(before["role_pid"]), 60, "the old trainer process gone")
    logged_before = len(steps_done(run_dir))  # what the killed trainer wrote; nothing more comes
    up.wait_for_line("trainer restarted", 240)
    up.wait_for_line("resumed from", 300)
    found = re.search(r"resumed from \S*global_step_(\d+) at step (\d+)", up.log())
    assert found and found.group(1) == found.group(2), up.log()[-3000:]
    step = int(found.group(2))
    assert step >= 2 and step % 2 == 0
    up.wait_until(
        lambda: step + 1 in steps_done(run_dir)[logged_before:],
        300,
        f"step {step + 1} trained again after the restart",
    )


def newest_checkpoint(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[-1]) for p in (run_dir / "checkpoints").glob("global_step_*")]
    return max(steps, default=0)


def scale(run_dir: Path, count: int) -> str:
    """`rlfleet scale rollout=COUNT` for the run in ``run_dir``; its output."""
    argv = [sys.executable, "-m", "rlfleet.cli", "scale", f"rollout={count}", f"run_dir={run_dir}"]
    result = subprocess.run(
        argv, cwd=ROOT, env=clean_env(**CLUSTER_ENV), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_ctrl_c_stops_every_actor_and_role(fleet):
    up, run_dir = fleet
    actors = [int(pid) for pid in re.findall(r"\(actor pid (\d+),", up.log())]  # restarts too
    assert len(actors) >= 5
    assert up.stop(signal.SIGINT, grace_s=120) == 130
    assert wait_gone(str(run_dir)) == []
    deadline = time.monotonic() + 60
    while any(map(alive, actors)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in actors if alive(pid)]
