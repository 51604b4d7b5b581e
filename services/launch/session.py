"""What an ``rlfleet up`` run does around its roles, whatever the backend (local processes or
Ray actors): the embedded Redis it starts first, and the summary it prints last."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.common.config import RlfleetConfig

if TYPE_CHECKING:
    from rlfleet.common.redis_server import EmbeddedRedis


def say(config: RlfleetConfig, message: str) -> None:
    """A launcher line about the run (where its parts are, what changed). ``rlfleet up -q``
    (log_level WARNING or above) keeps these to itself: warnings and the summary only."""
    if logging.getLevelName(config.log_level) <= logging.INFO:
        print(message, flush=True)


def print_run_summary(path: Path) -> None:
    """The job's headline numbers, unprefixed, as the last lines ``rlfleet up`` prints."""
    import json

    if not path.is_file():
        return
    summary = json.loads(path.read_text())
    reached = summary.get("time_to_target_s")
    target = summary.get("target_accuracy", 0.85)
    before, after = summary.get("val_before", {}), summary.get("val_after", {})
    for name, value in after.items():
        start = f"{before[name]:.3f}" if name in before else "n/a"
        print(f"held-out {name}: {start} -> {value:.3f}")
    print(f"time_to_{target:g}_s: {'never' if reached is None else reached}")
    print(
        f"training_time_s: {summary.get('training_time_s')}  wall_time_s: {summary['wall_time_s']}"
    )


def start_redis(config: RlfleetConfig, run_dir: Path) -> EmbeddedRedis | None:
    """Embedded Valkey when no Redis URL is configured; None otherwise."""
    if config.redis_url:
        return None
    from rlfleet.common.redis_server import EmbeddedRedis

    # AOF on: a restart keeps its data. The password (redis_password) from a file, not argv.
    server = EmbeddedRedis(run_dir / "redis", fresh=True, password=config.redis_password)
    server.start()
    say(config, f"rlfleet up: embedded Redis at 127.0.0.1:{server.port}")
    return server


def fleet_redis_url(config: RlfleetConfig, embedded: EmbeddedRedis | None) -> str:
    """The Redis every role dials: the one ``start_redis`` started, else ``redis_url``."""
    return embedded.url if embedded is not None else config.require_redis_url()


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise ``KeyboardInterrupt`` inside the block (the launcher then stops
    the fleet), restored on the way out. SIGINT is set explicitly because a process started
    with it ignored (a background job of a non-interactive shell, as a CI script starts things)
    keeps ignoring it: Python installs its Ctrl-C handler only where SIGINT was not ignored, and
    such a `rlfleet up` once outlived a `kill -INT` by over a minute."""
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
