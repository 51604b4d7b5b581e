"""``rlfleet scale rollout=N`` (or ``env=N``): change the number of rollout replicas (or of
env processes, agent mode) of a running ``rlfleet up --ray``. It finds the launcher's Ray
cluster and control actor in the run's ``endpoints.json`` (or ``--address``), asks for N, and
returns; the launcher starts or stops actors within a second or two. New replicas get the
current weights from the trainer before the router sends them work; new env processes are
``--worker-only`` ones that take episodes from the env stream at once."""

from __future__ import annotations

import argparse
import os
import sys

from rlfleet.launch.plan import SCALABLE  # replicas, and env processes of agent mode


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="rlfleet scale", description="Scale a role of a running `rlfleet up --ray`."
    )
    parser.add_argument("target", help="ROLE=N, e.g. rollout=4")
    parser.add_argument("--address", help="Ray cluster address (default: from endpoints.json)")
    parser.add_argument("--config", help="the YAML config of the run (for run_dir and cluster)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run_dir=runs/x")
    args = parser.parse_args(argv)
    role, _, count = args.target.partition("=")
    if role not in SCALABLE or not count.isdigit() or int(count) < 1:
        parser.error(
            f"target must be ROLE=N with ROLE in {SCALABLE} and N >= 1, got {args.target!r}"
        )
    args.role, args.count = role, int(count)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rlfleet.common.config import load_config
    from rlfleet.common.endpoints import read_endpoints
    from rlfleet.common.ray_cluster import QUIET_RAY
    from rlfleet.launch.ray_up import control_name

    config = load_config(args.config, args.overrides)
    entry = read_endpoints(config.run_dir).get("ray", {})
    address = args.address or entry.get("address")
    if not address:
        print(
            f"rlfleet scale: no `rlfleet up --ray` recorded in {config.run_dir}/endpoints.json;"
            " pass --address or the run's run_dir=...",
            file=sys.stderr,
        )
        return 2
    for name, value in QUIET_RAY.items():
        os.environ.setdefault(name, value)
    import ray

    ray.init(
        address=address, namespace=entry.get("namespace", config.ray.namespace), log_to_driver=False
    )
    try:
        control = ray.get_actor(entry.get("control", control_name(config.cluster)))
        before = ray.get(control.scale.remote(args.role, args.count))
    except ValueError as exc:
        print(f"rlfleet scale: no running fleet found on {address}: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"{args.role}: {before} -> {args.count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
