"""``rlfleet router``: the generation front door, until SIGTERM/SIGINT.

The router holds no state of its own (it all lives in Redis), so it needs ``redis_url`` and
can be restarted or run several times side by side.
"""

from __future__ import annotations

import asyncio
import logging

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.entry import base_parser, resolve

log = logging.getLogger(__name__)


async def serve(config: RlfleetConfig, port: int) -> None:
    """Run the gRPC server and the janitor until a stop signal arrives."""
    from rlfleet.common.grpc_server import GrpcServer, install_stop_signals
    from rlfleet.common.keys import Keys
    from rlfleet.common.redis_client import connect
    from rlfleet.rollout.router.core import RouterCore
    from rlfleet.rollout.router.server import registrations

    # No socket timeout: redis-py's default (5 s) wraps every write in asyncio.wait_for, which
    # on Python 3.11 can swallow task cancellation; keepalive and health checks catch dead links.
    redis = connect(config.redis_url)
    core = RouterCore(redis, Keys(config.cluster), config)
    server = GrpcServer(
        registrations(core), config.router.host, port, config.max_message_mb, config.api_key
    )
    stop = asyncio.Event()
    install_stop_signals(stop)
    await server.start()
    core.start()
    log.info("router ready on %s:%d (cluster %s)", config.router.host, server.port, config.cluster)
    try:
        await stop.wait()
        log.info("router stopping")
    finally:
        await server.stop()
        await core.close()
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(
        "router", "Route Generate calls to rollout replicas (least in-flight, sticky)."
    )
    parser.add_argument("--port", type=int, help="gRPC port (overrides router.port; 0 = any free)")
    config, args = resolve(parser, "router", argv)
    if not config.redis_url:
        parser.error("the router needs redis_url (set RLFLEET_REDIS_URL or redis_url=...)")
    port = config.router.port if args.port is None else args.port
    asyncio.run(serve(config, port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
