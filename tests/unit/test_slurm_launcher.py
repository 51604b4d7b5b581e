"""``rlfleet slurm``: the sbatch script it writes runs the fleet plan (``rlfleet.launch.plan``)
through ``rlfleet up --ray`` on a Ray cluster over the job's nodes, places each member on the
head or the workers, refuses what cannot run, and runs as written: the script is executed here
with stand-ins for ``scontrol``, ``srun``, ``ray`` and ``rlfleet`` on PATH (no Slurm, no Ray)."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from rlfleet.common.config import load_config
from rlfleet.launch import plan as plan_module
from rlfleet.launch import slurm
from rlfleet.launch.plan import Phase, PlannedRole, plan_fleet, plan_from_args
from rlfleet.launch.up import parse_args as parse_up

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
REDIS = "redis://redis.example:6379/0"


@pytest.fixture(autouse=True)
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RLFLEET_REDIS_URL", raising=False)


def write(*argv: str) -> str:
    """The script ``rlfleet slurm --dry-run ARGV`` writes (no venv line: ``--setup :``)."""
    assert slurm.main(["--dry-run", "--setup", ":", "--output", "job.sbatch", *argv]) == 0
    return Path("job.sbatch").read_text()


def sbatch_options(script: str) -> dict[str, str]:
    found = re.findall(r"^#SBATCH --([\w-]+)=(.*)$", script, re.M)
    return dict(found)


def up_line(script: str) -> list[str]:
    """``rlfleet up``'s argv after ``rlfleet up`` (continuation lines joined)."""
    joined = script.replace("\\\n", " ")
    (line,) = [x for x in joined.splitlines() if " rlfleet up --ray " in x]
    return shlex.split(line.split(" rlfleet up ", 1)[1])


def placed(script: str) -> dict[str, list[str]]:
    found = re.findall(r"^# (head|workers) \(\S+?[,)].*?: (.*)$", script, re.M)
    return {side: names.split() if names != "-" else [] for side, names in found}


def bash_syntax_ok(script: str) -> None:
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr


def test_one_node_runs_the_whole_plan_on_the_head():
    script = write("--partition", "debug", "--time", "30", "trainer.total_steps=5")
    options = sbatch_options(script)
    assert options["nodes"] == "1" and options["ntasks-per-node"] == "1"
    assert options["partition"] == "debug" and options["time"] == "30"
    assert options["chdir"] == str(Path.cwd()) and "gpus-per-node" not in options
    assert placed(script) == {"head": plan_fleet(load_config(), 2).names, "workers": []}
    assert len(re.findall(r"ray start --head", script)) == 1
    args = parse_up(up_line(script))
    assert args.ray == "$address" and args.rollout_replicas == 2 and args.config is None
    assert args.overrides[0] == "trainer.total_steps=5"
    config = load_config(None, args.overrides)
    assert config.ray.roles.rollout.resources == {"rlfleet_head": 1}
    assert "RLFLEET_REDIS_URL:?" not in script  # one node: the embedded Redis
    bash_syntax_ok(script)


def test_several_nodes_put_what_scales_on_the_workers(monkeypatch):
    monkeypatch.setenv("RLFLEET_REDIS_URL", REDIS)
    agent = str(CONFIGS / "agent_calc.yaml")
    script = write(
        "--config", agent, "--nodes", "3", "--gpus-per-node", "2", "--env-processes", "2"
    )
    assert sbatch_options(script)["gpus-per-node"] == "2"
    plan = plan_fleet(load_config(agent), 2, 2)
    sides = placed(script)
    assert sorted(sides["head"] + sides["workers"]) == sorted(plan.names)
    for names in sides.values():  # each side in the plan's start order
        assert names == [name for name in plan.names if name in names]
    assert sides["workers"] == ["rollout-0", "rollout-1", "env", "env-1"]
    assert re.search(r'ray start --address="\$address" .*rlfleet_worker', script)
    assert "--num-gpus=2" in script and "--gpus-per-node=2 -w" in script
    args = parse_up(up_line(script))
    assert args.config == agent and args.env_processes == 2
    # what `rlfleet up --ray` on the head will start is what the script says it places
    assert plan_from_args(load_config(agent, args.overrides), args).names == plan.names
    roles = load_config(agent, args.overrides).ray.roles
    assert roles.rollout.resources == roles.env.resources == {"rlfleet_worker": 1}
    assert roles.router.resources == roles.trainer.resources == {"rlfleet_head": 1}
    assert "RLFLEET_REDIS_URL:?" in script  # it came from this environment, not the config
    bash_syntax_ok(script)


def test_a_member_added_to_the_plan_shows_up_in_the_script(monkeypatch):
    def with_judge(*args, **kwargs):
        plan = plan_fleet(*args, **kwargs)
        judge = PlannedRole("judge", "reward", Phase.SERVERS, fixed_port=True)
        return plan_module.FleetPlan((*plan.members, judge))

    monkeypatch.setattr(plan_module, "plan_fleet", with_judge)
    assert "judge" in placed(write())["head"]
    # and it asks for room: 6 CPUs hold the default fleet, not with a judge
    assert slurm.main(["--dry-run", "--output", "7.sbatch", "--cpus-per-task", "7"]) == 0
    with pytest.raises(SystemExit, match="cannot hold"):
        slurm.main(["--dry-run", "--cpus-per-task", "6"])


def test_a_role_in_a_pool_is_left_to_its_placement_group():
    script = write("ray.pools.main.bundles=[{CPU: 2}]", "ray.roles.trainer.pool=main")
    roles = load_config(None, parse_up(up_line(script)).overrides).ray.roles
    assert roles.trainer.resources == {} and roles.router.resources == {"rlfleet_head": 1}


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--nodes", "0"], "--nodes must be >= 1"),
        (["--rollout-replicas", "0"], "must be >= 1"),
        (["--cpus-per-task", "2"], "cannot hold"),
        (["--nodes", "2", "--cpus-per-task", "1", "redis_url=" + REDIS], "secret"),
        (["--nodes", "2"], "needs a Redis every node reaches"),
        (["trainer.no_such_field=1"], "no_such_field"),
        (["ray.roles.reward.resources.node2=1"], "node2"),
        (["--config", "missing.yaml"], "missing.yaml"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(argv, why):
    with pytest.raises(SystemExit) as refused:
        slurm.main(["--dry-run", "--output", "job.sbatch", *argv])
    assert why in str(refused.value) and not Path("job.sbatch").exists()


def test_replicas_must_fit_the_workers(monkeypatch):
    monkeypatch.setenv("RLFLEET_REDIS_URL", REDIS)
    gpu = ["--nodes", "3", "--gpus-per-node", "1", "ray.roles.rollout.num_gpus=1"]
    write(*gpu, "--rollout-replicas", "2")
    with pytest.raises(SystemExit, match=r"cannot hold \['rollout-2'\]"):
        write(*gpu, "--rollout-replicas", "3")


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def stand_ins(folder: Path) -> None:
    """Slurm and Ray as shell stubs writing what they were asked to ``$CALLS``."""
    stub(folder, "scontrol", 'printf "n1\\nn2\\nn3\\n"\n')
    stub(folder, "hostname", "echo 10.0.0.1\n")
    stub(
        folder,
        "srun",
        'node=all\nwhile [[ "$1" == -* ]]; do\n'
        '  if [[ "$1" == -w ]]; then node=$2; shift; fi; shift\ndone\n'
        'echo "$node $*" >> "$CALLS"\nexec "$@"\n',
    )
    stub(folder, "ray", '[[ "$*" == *--block* ]] && exec sleep 30\nexit 0\n')
    # Ray's probe as it may answer: noise first, a failing exit after the count
    stub(folder, "python", 'sleep 0.2; echo noise; grep -c " ray start" "$CALLS"; exit 1\n')
    stub(folder, "rlfleet", 'echo "rlfleet $*" >> "$CALLS"; exit "$FLEET_EXIT"\n')


def test_the_script_starts_ray_then_the_fleet_and_stops_ray_on_exit(tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_REDIS_URL", REDIS)
    write("--nodes", "3", "trainer.total_steps=2")
    stand_ins(tmp_path)
    env = {
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "CALLS": str(tmp_path / "calls"),
        "SLURM_JOB_NODELIST": "n[1-3]",
        "RLFLEET_REDIS_URL": REDIS,
        "FLEET_EXIT": "3",
    }
    done = subprocess.run(
        ["bash", "job.sbatch"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr  # the fleet's exit code is the job's
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "n1 hostname --ip-address"
    assert calls[1].startswith("n1 ray start --head --node-ip-address=10.0.0.1 --port=6379")
    workers = [c.split()[0] for c in calls if "ray start --address=10.0.0.1:6379" in c]
    assert sorted(workers) == ["n2", "n3"]
    (fleet,) = [c for c in calls if c.startswith("n1 rlfleet up")]
    assert fleet.startswith("n1 rlfleet up --ray 10.0.0.1:6379 --rollout-replicas 2")
    assert calls.index(fleet) == len(calls) - 3 and calls[-2] == fleet[3:]
    assert calls[-1] == "all ray stop --force"  # the trap, after the fleet ended
    assert "3 Ray node(s) up" in done.stdout


def test_without_dry_run_it_submits_with_sbatch(tmp_path, monkeypatch):
    stub(tmp_path, "sbatch", 'echo "$@" > "$SUBMITTED"; echo "Submitted batch job 7"\n')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SUBMITTED", str(tmp_path / "submitted"))
    assert slurm.main(["--output", "job.sbatch"]) == 0
    assert (tmp_path / "submitted").read_text().split() == ["job.sbatch"]


def test_without_sbatch_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="sbatch is not on PATH"):
        slurm.main(["--output", "job.sbatch"])
    assert not Path("job.sbatch").exists()
