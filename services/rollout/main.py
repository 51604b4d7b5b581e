"""``rlfleet rollout``: run one rollout replica until SIGTERM/SIGINT (or a router drains it).

Only the command line is here; ``rlfleet.rollout.app`` assembles and runs the process,
imported after parsing so ``--help`` is instant (no torch, no vLLM). vLLM spawns child
processes, hence the ``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import sys

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.entry import base_parser, resolve
from rlfleet.common.keys import Keys
from rlfleet.rollout.replica_id import with_replica_id


def parse(argv: list[str] | None) -> RlfleetConfig:
    parser = base_parser("rollout", "Run one rollout replica (an inference engine).")
    parser.add_argument("--replica-id", help="stable replica id (overrides rollout.replica_id)")
    parser.add_argument("--port", type=int, help="gRPC port (overrides rollout.port; 0 = free)")
    args = [*(argv if argv is not None else sys.argv[1:]), *_flag_overrides(argv)]
    config, _ = resolve(parser, "rollout", args, with_replica_id)
    if not config.redis_url:
        parser.error("rlfleet rollout needs Redis: set RLFLEET_REDIS_URL or redis_url=redis://...")
    try:
        Keys(config.cluster).replica(config.rollout.replica_id or "probe")
    except ValueError as exc:
        parser.error(str(exc))
    return config


def _flag_overrides(argv: list[str] | None) -> list[str]:
    """``--replica-id`` and ``--port`` as dotted overrides, so they are in the config before
    it is recorded (``run_dir/config.<replica id>.yaml``: one file per replica)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--replica-id")
    flags.add_argument("--port", type=int)
    known, _ = flags.parse_known_args(argv)
    overrides = [f"rollout.replica_id={json.dumps(known.replica_id)}"] if known.replica_id else []
    return overrides + ([f"rollout.port={known.port}"] if known.port is not None else [])


def main(argv: list[str] | None = None) -> None:
    """Run a replica; after a clean stop the process exits at once (``app.exit_now``), so call
    ``app.serve`` instead to run one inside another program."""
    config = parse(argv)
    from rlfleet.rollout import app

    app.run(config)
    app.exit_now(0)


if __name__ == "__main__":
    main()
