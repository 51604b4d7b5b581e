"""``rlfleet up``: parse the command line, then run the fleet with the local backend
(``rlfleet.launch.local``: one process per role) or the Ray one (``rlfleet.launch.ray_up``:
one actor per role, with ``--ray`` or ``launcher: ray``)."""

from __future__ import annotations

import argparse

from rlfleet.common import tls
from rlfleet.common.config import load_config


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="rlfleet up", description="Run the whole fleet (and the training job) locally."
    )
    parser.add_argument("--config", help="YAML config shared by every role")
    parser.add_argument("--rollout-replicas", type=int, default=2, help="replicas (default 2)")
    parser.add_argument("--no-trainer", action="store_true", help="serve only, until Ctrl-C")
    parser.add_argument(
        "--env-processes",
        type=int,
        default=1,
        metavar="N",
        help="agent mode: env processes, the front door and N-1 worker-only ones (default 1)",
    )
    parser.add_argument(
        "--dashboard-port",
        type=int,
        metavar="PORT",
        help="port of the live page (dashboard.port; default: a free one)",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the roles as Ray actors, on the cluster at ADDRESS or a local one",
    )
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v", "--verbose", action="store_true", help="DEBUG logs from every role (log_level=DEBUG)"
    )
    loudness.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="warnings and the end summary only (log_level=WARNING)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every role")
    args = parser.parse_args(argv)
    if args.ray and "=" in args.ray:  # `--ray a.b=c`: an override, not an address
        args.overrides, args.ray = [args.ray, *args.overrides], ""
    if args.dashboard_port is not None:
        args.overrides.append(f"dashboard.port={args.dashboard_port}")
    if args.verbose or args.quiet:  # last, so the flag wins over a log_level= override
        args.overrides.append(f"log_level={'DEBUG' if args.verbose else 'WARNING'}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rollout_replicas < 1 or args.env_processes < 1:
        raise SystemExit("rlfleet up: --rollout-replicas and --env-processes must be >= 1")
    config = load_config(args.config, args.overrides)
    tls.use(config.tls)  # URLs it prints and records say https when the roles serve TLS
    from rlfleet.model.local_models import check_context

    check_context(config.model.path, config.rollout.max_model_len)  # before any role starts
    if args.ray is not None or config.launcher == "ray":
        from rlfleet.launch.ray_up import run_on_ray

        return run_on_ray(config, args)
    from rlfleet.launch.local import run_local

    return run_local(config, args)


if __name__ == "__main__":
    raise SystemExit(main())
