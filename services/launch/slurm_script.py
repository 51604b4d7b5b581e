"""The sbatch script of ``rlfleet slurm``: a Ray cluster over the job's nodes, then
``rlfleet up --ray`` on its head, the same launcher (and the same fleet plan) as anywhere else.

The script, top to bottom: ``#SBATCH`` lines; the plan's members by node, as comments; the
setup lines (a venv); the head's address from ``scontrol show hostnames``; ``ray start --head``
on the first node and ``ray start --address`` on every other one (each a blocking ``srun``
step, labelled ``rlfleet_head`` or ``rlfleet_worker``: ``slurm_plan``); a wait until every node
joined; ``rlfleet up --ray HEAD:PORT`` on the head, whose exit code is the job's. A trap stops
Ray on every node and ends the steps on any exit, a failure or ``scancel`` included.

Pure text: nothing here runs Slurm.
"""

from __future__ import annotations

import json
import shlex

from rlfleet.launch.plan import FleetPlan
from rlfleet.launch.slurm_plan import HEAD, LABEL_UNITS, WORKER, SlurmJob, layout

NO_REDIS = "set it to a Redis every node reaches (the config names none)"

FUNCTIONS = r"""
stop_ray() {
    # Every exit (the fleet done or failed, scancel): Ray off on every node, then its steps.
    trap - EXIT
    srun --overlap --nodes="${#nodes[@]}" --ntasks-per-node=1 ray stop --force >/dev/null 2>&1 || true
    kill "${steps[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
}

alive_nodes() {
    # The number of live nodes in the Ray cluster at $address (0 while it is not up).
    local count probe='import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(1 for node in ray.nodes() if node["Alive"]))'
    count=$(python -c "${probe}" "$address" 2>/dev/null | tail -n 1) || true
    if [[ "${count}" =~ ^[0-9]+$ ]]; then echo "${count}"; else echo 0; fi
}

wait_for_nodes() {
    # Until $1 nodes joined the Ray cluster, for at most $WAIT_S seconds.
    local deadline=$((SECONDS + WAIT_S)) alive=0
    while alive=$(alive_nodes) && ((alive < $1)); do
        if ((SECONDS >= deadline)); then
            echo "rlfleet slurm: ${alive} of $1 Ray nodes up after ${WAIT_S} s" >&2
            exit 1
        fi
        sleep 5
    done
    echo "rlfleet slurm: ${alive} Ray node(s) up at ${address}"
}
"""


def render(
    job: SlurmJob, plan: FleetPlan, up_args: list[list[str]], needs_redis_env: bool = False
) -> str:
    """The whole script for ``job``, running ``plan`` with ``rlfleet up --ray HEAD:PORT``
    followed by ``up_args`` (a line each). ``needs_redis_env``: the config names no Redis, so
    the job stops at once unless ``RLFLEET_REDIS_URL`` is in its environment."""
    parts = [header(job), about(plan, job.nodes), prelude(job, needs_redis_env)]
    parts.append(FUNCTIONS.strip("\n"))
    parts += [start_ray(job), run_fleet(up_args)]
    return "\n\n".join(parts) + "\n"


def header(job: SlurmJob) -> str:
    options = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={job.cpus_per_task}",
    ]
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.partition:
        options.append(f"--partition={job.partition}")
    if job.time:
        options.append(f"--time={job.time}")
    options += [f"--chdir={job.workdir}", f"--output={job.log_file}", *job.sbatch]
    return "\n".join(["#!/bin/bash", *(f"#SBATCH {option}" for option in options)])


def about(plan: FleetPlan, nodes: int) -> str:
    """The plan's members by node, for the reader (and the tests)."""
    placed = layout(plan, nodes)
    return "\n".join(
        [
            "# Written by `rlfleet slurm` from the fleet plan (rlfleet.launch.plan) that",
            "# `rlfleet up` and `rlfleet up --ray` start; Ray places each member by its label.",
            f"# head ({HEAD}): {' '.join(placed[HEAD]) or '-'}",
            f"# workers ({WORKER}, {nodes - 1} node(s)): {' '.join(placed[WORKER]) or '-'}",
        ]
    )


def prelude(job: SlurmJob, needs_redis_env: bool) -> str:
    lines = ["set -euo pipefail", *job.setup]
    if needs_redis_env:
        lines.append(f': "${{RLFLEET_REDIS_URL:?{NO_REDIS}}}"')
    lines += [
        f"RAY_PORT={job.ray_port}",
        f"WAIT_S={job.wait_s}",
        'mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'head="${nodes[0]}"',
        "head_ip=$(srun --nodes=1 --ntasks=1 -w \"$head\" hostname --ip-address | awk '{print $1}')",
        'address="${head_ip}:${RAY_PORT}"',
        "steps=()",
    ]
    return "\n".join(lines)


def step(job: SlurmJob, node: str) -> str:
    """A blocking step on one node; it holds the node's GPUs for Ray's workers."""
    gpus = f" --gpus-per-node={job.gpus_per_node}" if job.gpus_per_node else ""
    return f'srun --nodes=1 --ntasks=1{gpus} -w "${node}"'


def ray_start(job: SlurmJob, label: str) -> str:
    """The node's resources for Ray: all the task's CPUs and the node's GPUs, and its label."""
    resources = shlex.quote(json.dumps({label: LABEL_UNITS}))
    return (
        f"--num-cpus={job.cpus_per_task} --num-gpus={job.gpus_per_node} "
        f"--resources={resources} --block"
    )


def start_ray(job: SlurmJob) -> str:
    return "\n".join(
        [
            "trap stop_ray EXIT",
            "trap 'exit 143' INT TERM",
            f'{step(job, "head")} ray start --head --node-ip-address="$head_ip" '
            f'--port="$RAY_PORT" {ray_start(job, HEAD)} &',
            "steps+=($!)",
            "wait_for_nodes 1",
            'for node in "${nodes[@]:1}"; do',
            f'    {step(job, "node")} ray start --address="$address" {ray_start(job, WORKER)} &',
            "    steps+=($!)",
            "done",
            'wait_for_nodes "${#nodes[@]}"',
        ]
    )


def run_fleet(up_args: list[list[str]]) -> str:
    """The launcher on the head, beside Ray's head step (``--overlap``: that step holds the
    node's CPUs); its exit code is the job's."""
    command = ['srun --overlap --nodes=1 --ntasks=1 -w "$head" rlfleet up --ray "$address"']
    command += [f"    {shlex.join(line)}" for line in up_args]
    return "\n".join(["set +e", " \\\n".join(command), "code=$?", 'exit "$code"'])
