"""``rlfleet dashboard``: the live page of a run (``rlfleet up`` starts it with the fleet).

Only the command line is here; ``rlfleet.dashboard.app`` runs the process. It needs the same
config as the fleet (endpoints, ``redis_url``, ``run_dir``, ``api_key``); started by hand
against a running ``rlfleet up``, pass the addresses from ``run_dir/endpoints.json``.
"""

from __future__ import annotations

import asyncio
import logging

from rlfleet.common.entry import base_parser, resolve


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("dashboard", "Serve the live dashboard page of a run.")
    parser.add_argument("--port", type=int, help="HTTP port (overrides dashboard.port)")
    config, args = resolve(parser, "dashboard", argv)
    if config.log_level != "DEBUG":  # one line per replica scrape each second otherwise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.port is not None:
        config.dashboard.port = args.port
    from rlfleet.dashboard.app import serve

    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
