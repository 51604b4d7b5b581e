"""``rlfleet refcritic``: serve reference log-probs and the critic until SIGTERM/SIGINT.

torch and transformers are imported only after the arguments parse, so ``--help`` is instant.
"""

from __future__ import annotations

import asyncio
import sys

from services.common.entry import base_parser, resolve


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("refcritic", "Frozen reference policy log-probs and the PPO critic.")
    parser.add_argument("--port", type=int, help="gRPC port (overrides refcritic.port)")
    config, args = resolve(parser, "refcritic", argv)
    if args.port is not None:
        config.refcritic.port = args.port
    from services.refcritic.server import serve

    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
