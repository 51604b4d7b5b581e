"""``rlfleet router``: the generation front door, until SIGTERM/SIGINT.

Only the command line is here; ``rlfleet.rollout.router.app`` assembles and runs the process,
imported after parsing so ``--help`` is instant. The router needs ``redis_url``: all its state
lives in Redis.
"""

from __future__ import annotations

from rlfleet.common.entry import base_parser, resolve


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        "router", "Route Generate calls to rollout replicas (least in-flight, sticky)."
    )
    parser.add_argument("--port", type=int, help="gRPC port (overrides router.port; 0 = any free)")
    config, args = resolve(parser, "router", argv)
    if not config.redis_url:
        parser.error("the router needs redis_url (set RLFLEET_REDIS_URL or redis_url=...)")
    port = config.router.port if args.port is None else args.port
    from rlfleet.rollout.router.app import run

    run(config, port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
