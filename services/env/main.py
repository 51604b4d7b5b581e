"""``rlfleet env``: the env service (gRPC front door and episode workers) in one process.

Only the command line is here; ``rlfleet.env.app`` assembles and runs the process, imported
after parsing so ``--help`` is instant. ``--worker-only`` runs just episode workers on the
service's Redis stream, so episodes scale out by starting more processes.
"""

from __future__ import annotations

from rlfleet.common.entry import base_parser, resolve


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("env", "Run agent episodes: the Env gRPC front door and its workers.")
    parser.add_argument("--port", type=int, help="gRPC port (overrides agent.port)")
    parser.add_argument("--worker-only", action="store_true", help="run only episode workers")
    config, args = resolve(parser, "env", argv)
    if args.worker_only and not config.redis_url:
        parser.error("--worker-only needs the service's Redis: redis_url=... or RLFLEET_REDIS_URL")
    if args.worker_only and config.agent.workers < 1:
        parser.error("--worker-only needs agent.workers >= 1")
    if config.agent.workers > 0 and not config.agent.env:
        parser.error("episode workers need agent.env (a built-in such as calc, or module:attr)")
    if args.port is not None:
        config.agent.port = args.port
    from rlfleet.env.app import Options, run

    if not run(config, Options(args.worker_only)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
