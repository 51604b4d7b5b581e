"""A serving fleet for a tool that needs one for a while: router, replicas, reward.

Why: ``rlfleet data filter`` (and tools like it) samples from a model through the fleet, the
path training uses, so that what it measures is what the replicas serve. When no fleet is
running, it starts one itself, as ``rlfleet up --no-trainer`` would (the same plan,
``local.plan_children``, the same embedded Redis), but only the roles generation and scoring
need, in a run directory and on a cluster name of its own (so it never meets a training run's
replicas in a shared Redis), and stops it, every process it started and nothing else, however
the tool ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
import threading
import time
import uuid
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlfleet.common.config import RlfleetConfig, load_config
from rlfleet.common.endpoints import read_endpoints
from rlfleet.launch.local import plan_children, report_failure, stop_all
from rlfleet.launch.process import RoleProcess
from rlfleet.launch.session import fleet_redis_url, start_redis

SERVING_ROLES = ("router", "rollout-", "reward")
"""Name prefixes of the roles a serving fleet runs (no trainer, refcritic, env, dashboard)."""

READY_POLL_S = 0.5


@dataclass(frozen=True)
class FleetAddresses:
    router: str
    reward: str
    run_dir: str


class FleetDied(RuntimeError):
    """A role of the fleet we started exited before it was ready (its log tail is printed)."""


@contextlib.contextmanager
def serving_fleet(
    config_path: str | None, overrides: list[str], replicas: int = 1, wait_s: float = 600.0
) -> Iterator[FleetAddresses]:
    """Start router, ``replicas`` rollout replicas and reward for ``config_path`` +
    ``overrides``; yield their addresses once ``replicas`` replicas serve; always stop them
    (on SIGTERM too). Without a ``run_dir`` override the fleet's logs go to a scratch
    directory, removed at the end unless a role died or timed out (the error names its log)."""
    scratch = tempfile.mkdtemp(prefix="rlfleet-serving-")
    own = [
        f"run_dir={scratch}",
        "log_level=WARNING",
        f"cluster=serving-{uuid.uuid4().hex[:8]}",
        "dashboard.enabled=false",
    ]
    overrides = [*own, *overrides]  # the user's settings win, run_dir and cluster included
    config = load_config(config_path, overrides)
    keep = False  # the logs of a fleet that did not start or answer, in the scratch directory
    try:
        with _running(config, config_path, overrides, replicas, wait_s) as addresses:
            yield addresses
    except (FleetDied, TimeoutError):
        keep = Path(config.run_dir) == Path(scratch)
        raise
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _running(
    config: RlfleetConfig, config_path, overrides, replicas: int, wait_s: float
) -> Iterator[FleetAddresses]:
    from rlfleet.model.local_models import check_context

    check_context(config.model.path, config.rollout.max_model_len)
    redis = start_redis(config, Path(config.run_dir))
    children: list[RoleProcess] = []
    main = threading.current_thread() is threading.main_thread()  # where signals are handled
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None
    try:
        children = _plan(config, config_path, overrides, replicas, redis)
        for child in children:
            child.start()
        found = read_endpoints(config.run_dir)  # what plan_children recorded
        addresses = FleetAddresses(found["router"]["grpc"], found["reward"]["grpc"], config.run_dir)
        asyncio.run(_wait_ready(config, addresses, children, replicas, wait_s))
        yield addresses
    finally:
        stop_all(children)
        if redis is not None:
            redis.stop()
        if main:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _plan(config: RlfleetConfig, config_path, overrides, replicas: int, redis) -> list[RoleProcess]:
    args = Namespace(
        config=config_path,
        overrides=overrides,
        rollout_replicas=replicas,
        no_trainer=True,
        env_processes=1,
    )
    log_dir = Path(config.run_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    children = plan_children(config, args, fleet_redis_url(config, redis), log_dir)
    return [c for c in children if c.name.startswith(SERVING_ROLES)]


async def _wait_ready(
    config: RlfleetConfig,
    at: FleetAddresses,
    children: list[RoleProcess],
    replicas: int,
    wait_s: float,
) -> None:
    """Until ``replicas`` replicas serve and reward answers; ``FleetDied`` if a role exits."""
    from rlfleet.reward.client import RewardClient
    from rlfleet.rollout.client import RolloutClient

    deadline = time.monotonic() + wait_s
    async with RolloutClient(at.router, config.api_key) as router:
        while await _serving(router) < replicas:
            _check_alive(children)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{replicas} rollout replicas did not serve in {wait_s:g} s "
                    f"(logs: {at.run_dir}/logs)"
                )
            await asyncio.sleep(READY_POLL_S)
    async with RewardClient(at.reward, config.api_key) as reward:
        await reward.wait_ready(max(1.0, deadline - time.monotonic()))


async def _serving(router) -> int:
    from rlfleet.common.errors import RlfleetError
    from rlfleet.rollout.types import ReplicaState

    try:
        listed = await router.list_replicas(timeout_s=2.0)
    except (RlfleetError, TimeoutError):
        return 0  # the router is not up yet
    return sum(r.state == ReplicaState.SERVING for r in listed)


def _check_alive(children: list[RoleProcess]) -> None:
    for child in children:
        if (code := child.exited()) is not None:
            report_failure(child, code)
            raise FleetDied(
                f"the fleet's {child.name} exited with code {code} while starting "
                f"(its log: {child.log_path})"
            )
