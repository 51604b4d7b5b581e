"""``rlfleet refcritic``: serve reference log-probs and the critic until SIGTERM/SIGINT.

Only the command line is here; ``rlfleet.refcritic.app`` assembles and runs the process (the
direct path, or the Redis queue path when ``redis_url`` is set), imported after parsing so
``--help`` is instant. ``--worker-only`` runs just reference workers on the queue.
"""

from __future__ import annotations

import argparse

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.entry import base_parser, resolve


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("refcritic", "Frozen reference policy log-probs and the PPO critic.")
    parser.add_argument("--port", type=int, help="gRPC port (overrides refcritic.port)")
    parser.add_argument(
        "--worker-only", action="store_true", help="run only queue workers (needs redis_url)"
    )
    config, args = resolve(parser, "refcritic", argv)
    check_args(parser, config, args)
    if args.port is not None:
        config.refcritic.port = args.port
    from rlfleet.refcritic.app import run

    return 0 if run(config, args.worker_only) else 1


def check_args(
    parser: argparse.ArgumentParser, config: RlfleetConfig, args: argparse.Namespace
) -> None:
    if args.worker_only and not config.redis_url:
        parser.error("--worker-only needs Redis: set redis_url=... or RLFLEET_REDIS_URL")
    if config.redis_url and config.refcritic.workers < 1:
        parser.error("with redis_url set, refcritic.workers must be >= 1")


if __name__ == "__main__":
    raise SystemExit(main())
