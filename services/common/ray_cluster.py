"""The Ray cluster under ``rlfleet up --ray``: join one at an address, or start a local one
that lives exactly as long as the launcher (``ray.shutdown`` stops every process it started,
also after a failure or Ctrl-C); reserve the resource pools as placement groups.

Why in ``common`` and not in ``rlfleet.launch``: the trainer's DDP ranks join (or start) a
cluster with the same ``connect``, and a role must not import the launcher above it. Ray itself
is imported only inside functions."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlfleet.common.config.ray import RayConfig

QUIET_RAY = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
"""No usage report from an offline machine; every replica's lines shown, not deduplicated."""


class PlacementError(RuntimeError):
    """Ray could not give a pool or a role its resources in time."""


@dataclass
class Cluster:
    address: str
    """The GCS address other drivers (``rlfleet scale``) join."""
    local: bool
    """Started by us (and stopped by ``shutdown``)."""
    temp_dir: Path | None = None
    """A local cluster's own fresh folder for Ray's session files: what ``reap`` looks for,
    removed at shutdown."""

    def shutdown(self, keep_temp: bool = False) -> None:
        import ray

        ray.shutdown()
        if self.temp_dir is not None:
            reap(self.temp_dir)
            if not keep_temp:
                shutil.rmtree(self.temp_dir, ignore_errors=True)


def reap(session: Path) -> list[int]:
    """SIGKILL every process whose command line names our local cluster's session folder
    (Ray's own processes all do), should any outlive ``ray.shutdown`` or a failed start."""
    killed = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(session) in (entry / "cmdline").read_text():
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except (OSError, UnicodeDecodeError):  # gone meanwhile, or not ours to read
            continue
    return killed


def connect(config: RayConfig, address: str | None, cpus: int) -> Cluster:
    """Join ``address`` (or ``ray.address``, or ``RAY_ADDRESS``); with none, start a local
    cluster of ``cpus`` CPUs."""
    for name, value in QUIET_RAY.items():
        os.environ.setdefault(name, value)
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # plain "(rollout-0 pid=...)" in logs
    import ray

    address = address or config.address or os.environ.get("RAY_ADDRESS")  # set in a Ray job
    if not address:
        return start_local(config, cpus)
    ray.init(address=address, namespace=config.namespace, log_to_driver=True)
    return Cluster(ray.get_runtime_context().gcs_address, local=False)


def start_local(config: RayConfig, cpus: int) -> Cluster:
    """A local cluster in a fresh folder of its own; a start that fails leaves nothing."""
    import ray

    parent = Path(config.temp_dir or "/tmp").resolve()
    parent.mkdir(parents=True, exist_ok=True)
    session = Path(tempfile.mkdtemp(prefix="rlf-", dir=parent))
    for attempt in (1, 2):
        try:
            init_local(config, cpus, session)
            break
        except BaseException as exc:  # a bare Exception when its node registers late; Ctrl-C
            reap(session)
            if attempt == 2 or "timed out during startup" not in str(exc):
                shutil.rmtree(session, ignore_errors=True)
                raise
            print(
                "rlfleet up: Ray's local node was slow to register (a busy machine?); "
                "starting it once more",
                file=sys.stderr,
                flush=True,
            )
    return Cluster(ray.get_runtime_context().gcs_address, local=True, temp_dir=session)


def init_local(config: RayConfig, cpus: int, session: Path) -> None:
    import ray

    ray.init(
        num_cpus=cpus,
        num_gpus=config.num_gpus,
        object_store_memory=config.object_store_memory_mb * 1024 * 1024,
        include_dashboard=False,
        namespace=config.namespace,
        log_to_driver=True,
        _temp_dir=str(session),
    )


def one_machine() -> bool:
    """Whether every live node runs on this machine (then the fleet binds loopback and the
    embedded Redis, which listens on 127.0.0.1, is reachable from every role)."""
    import ray

    here = ray.util.get_node_ip_address()
    return all(node["NodeManagerAddress"] == here for node in ray.nodes() if node["Alive"])


def reserve_pools(config: RayConfig, cluster_name: str, timeout_s: float) -> dict:
    """One placement group per pool, all reserved before any role starts (or a clear error)."""
    import ray
    from ray.util.placement_group import placement_group

    groups = {
        name: placement_group(pool.bundles, strategy=pool.strategy, name=f"{cluster_name}-{name}")
        for name, pool in config.pools.items()
    }
    for name, group in groups.items():
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            pool = config.pools[name]
            raise PlacementError(
                f"ray.pools.{name}: placement group {pool.bundles} ({pool.strategy}) not "
                f"reserved within {timeout_s:.0f} s; the cluster has {ray.cluster_resources()}"
            )
    return groups
