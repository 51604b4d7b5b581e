"""``rlfleet slurm``: the fleet as one Slurm batch job, a Ray cluster over its nodes running
``rlfleet up --ray`` on its head.

Why through Ray rather than one ``srun`` per role: ``rlfleet up --ray`` already starts, places,
restarts and scales the fleet plan's members (``rlfleet.launch.plan``), so the job only has to
bring up Ray; the roles and their order stay the plan's, as for ``rlfleet up`` and Kubernetes.
Where each member goes (head or workers) is ``slurm_plan``; the script's text is
``slurm_script``. ``--dry-run`` writes the script and submits nothing.

Only ``argparse`` is imported before the arguments are parsed, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlfleet slurm",
        description="Write (and submit) an sbatch script: Ray on the job's nodes, then "
        "`rlfleet up --ray` on the first one.",
    )
    parser.add_argument("--config", help="YAML config shared by every role")
    parser.add_argument("--nodes", type=int, default=1, help="nodes: 1 head + N-1 workers")
    parser.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    parser.add_argument("--time", help="time limit, e.g. 1-00:00:00 (default: the partition's)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
    parser.add_argument("--cpus-per-task", type=int, default=8, help="CPUs per node (default 8)")
    parser.add_argument("--rollout-replicas", type=int, default=2, help="replicas (default 2)")
    parser.add_argument(
        "--env-processes", type=int, default=1, metavar="N", help="agent mode: env processes"
    )
    parser.add_argument("--job-name", default="rlfleet", help="Slurm job name (default rlfleet)")
    parser.add_argument("--ray-port", type=int, default=6379, help="Ray head port (default 6379)")
    parser.add_argument(
        "--setup",
        action="append",
        metavar="LINE",
        help="shell line run first (repeatable; default: activate this Python's venv)",
    )
    parser.add_argument(
        "--sbatch", action="append", default=[], metavar="OPT", help="more #SBATCH options"
    )
    parser.add_argument("--output", metavar="FILE", help="write the script here (default stdout)")
    parser.add_argument(
        "--dry-run", action="store_true", help="write the script only, never call sbatch"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every role")
    return parser.parse_args(argv)


def default_setup() -> tuple[str, ...]:
    """Activate the venv this command runs from (on a filesystem the nodes share), if any."""
    import shlex
    import sys

    if sys.prefix == sys.base_prefix:
        return ()
    return (f"source {shlex.quote(sys.prefix)}/bin/activate",)


def build(args: argparse.Namespace) -> str:
    """The script for ``args``, or a ``ValueError`` saying what is wrong with them."""
    from pathlib import Path

    from rlfleet.common.config import load_config
    from rlfleet.launch import slurm_plan as sp
    from rlfleet.launch.plan import plan_fleet
    from rlfleet.launch.process import split_secrets
    from rlfleet.launch.slurm_script import render

    job = sp.SlurmJob(
        nodes=args.nodes,
        cpus_per_task=args.cpus_per_task,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        time=args.time,
        job_name=args.job_name,
        workdir=str(Path.cwd()),
        ray_port=args.ray_port,
        setup=tuple(default_setup() if args.setup is None else args.setup),
        sbatch=tuple(args.sbatch),
    )
    job.check()
    if args.rollout_replicas < 1 or args.env_processes < 1:
        raise ValueError("--rollout-replicas and --env-processes must be >= 1")
    if split_secrets(args.overrides)[1]:
        raise ValueError(
            "a secret (api_key, redis_url, redis_password) would be written into the script: "
            "set it in the environment sbatch runs in (RLFLEET_API_KEY, RLFLEET_REDIS_URL, ...)"
        )
    config = load_config(args.config, args.overrides)  # unknown keys fail here
    plan = plan_fleet(config, args.rollout_replicas, args.env_processes)
    sp.check_resources(config, plan)
    placement = sp.placement_overrides(config, plan, job.nodes)
    overrides = [*args.overrides, *placement]
    load_config(args.config, overrides)  # what `rlfleet up` on the head will load
    sp.check_fits(config, plan, job)
    if job.nodes > 1 and not config.redis_url:
        raise ValueError(
            "a fleet over several nodes needs a Redis every node reaches: set redis_url in the "
            "config, or RLFLEET_REDIS_URL in the environment sbatch runs in"
        )
    config_path = str(Path(args.config).resolve()) if args.config else None
    up = sp.up_arguments(config_path, args.rollout_replicas, args.env_processes, overrides)
    from_env = not load_config(args.config, args.overrides, env={}).redis_url
    return render(job, plan, up, needs_redis_env=job.nodes > 1 and from_env)


def find_sbatch() -> str:
    import shutil

    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SystemExit(
            "rlfleet slurm: sbatch is not on PATH (not a Slurm login node?); "
            "--dry-run writes the script without submitting it"
        )
    return sbatch


def submit(sbatch: str, script: str, path: str | None) -> int:
    """``sbatch`` the script (the file ``path``, else on its standard input)."""
    import subprocess

    if path is not None:
        return subprocess.run([sbatch, path]).returncode
    return subprocess.run([sbatch], input=script, text=True).returncode


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sbatch = None if args.dry_run else find_sbatch()  # before anything is written
    try:
        script = build(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"rlfleet slurm: {exc}") from None
    if args.output:
        from pathlib import Path

        Path(args.output).write_text(script)
    elif sbatch is None:
        print(script, end="")
    return 0 if sbatch is None else submit(sbatch, script, args.output)


if __name__ == "__main__":
    raise SystemExit(main())
