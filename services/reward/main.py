"""``rlfleet reward``: the reward service (gRPC, optional HTTP, and its workers) in one process.

Only the command line is here; ``rlfleet.reward.app`` assembles and runs the process, imported
after parsing so ``--help`` is instant. ``--worker-only`` runs just workers on the service's
Redis stream, so scoring scales out by starting more processes.
"""

from __future__ import annotations

from rlfleet.common.entry import base_parser, resolve


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("reward", "Score responses: gRPC + HTTP front doors and workers.")
    parser.add_argument("--port", type=int, help="gRPC port (overrides reward.port)")
    parser.add_argument("--worker-only", action="store_true", help="run only reward workers")
    parser.add_argument(
        "--item-timeout-s",
        type=float,
        default=10.0,
        help="longest a user scoring function may run on one item",
    )
    parser.add_argument(
        "--reclaim-idle-s",
        type=float,
        default=10.0,
        help="a job pending this long on another worker is taken over (that worker died)",
    )
    config, args = resolve(parser, "reward", argv)
    if args.worker_only and not config.redis_url:
        parser.error("--worker-only needs the service's Redis: redis_url=... or RLFLEET_REDIS_URL")
    if args.worker_only and config.reward.workers < 1:
        parser.error("--worker-only needs reward.workers >= 1")
    if args.port is not None:
        config.reward.port = args.port
    from rlfleet.reward.app import Options, run

    if not run(config, Options(args.worker_only, args.item_timeout_s, args.reclaim_idle_s)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
