"""The ``torch.distributed`` group that carries a push's bytes (``trainer.weight_transport:
broadcast``): what a header says about it, its store keys, and opening it and broadcasting on
it, for both ends (the trainer's ``rlfleet.trainer.weight_broadcast``, the replica's
``rlfleet.rollout.weight_broadcast``).

Why a collective: a streamed push sends the model once per replica through gRPC's framing
(4 MiB messages, each copied into and out of protobuf's wire form). A broadcast sends one flat
uint8 buffer, the encoded payload as it is (never one call per tensor), on a group the
trainer owns as rank 0; on NCCL it would move over the GPUs' links.

Control stays on gRPC: the header (version, manifest, checksum) still goes over
``Rollout.UpdateWeights`` and names the group (``BroadcastGroup``); no data chunks follow it.

One group per membership epoch: the trainer starts a fresh TCP store (a new port) whenever the
replicas it broadcasts to change or the last group failed, and ranks them in push order. Every
push is one round on the group, with a handshake in the store before any collective: each
member writes ``ready`` once it accepted the header (and joined the store), the trainer writes
``go`` when all did, or ``abort`` as soon as one answered without being ready (it refused, or
is dead) or the deadline passed, or when a member would open a group the trainer holds open
already (it restarted, or left the group: the epoch is then rebuilt on the next push). So a
dead member costs the others no collective timeout;
after ``go`` the group is opened (a new epoch) and the buffer broadcast, each under
``timeout_s``, so a member that dies in between makes the others wait at most that long.

The backend is ``gloo`` on CPU; ``nccl`` where the trainer has CUDA (written, never run: no
GPU with several ranks was at hand). Plain data and thin wrappers: torch is imported on use.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlfleet.common.host_address import split_host

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Store

GO, ABORT = b"go", b"abort"
OPEN, JOINING = b"open", b"joining"
"""A member's ``ready``: it holds the epoch's group open, or opens it on ``go``."""
POLL_S = 0.005
"""How often the trainer looks at the store for the members' ``ready`` keys."""


@dataclass(frozen=True)
class BroadcastGroup:
    """Where one update's payload comes from (``WeightUpdateHeader.broadcast``)."""

    store: str
    """``host:port`` of the epoch's TCP store (the trainer's)."""
    epoch: int
    round: int
    """This push's number: the keys of its handshake."""
    rank: int
    """The receiver's rank; the trainer is 0."""
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    """For joining, for the handshake and for the collective, each."""


def ready_key(round_: int, rank: int) -> str:
    return f"round/{round_}/ready/{rank}"


def go_key(round_: int) -> str:
    return f"round/{round_}/go"


def default_backend() -> str:
    """``nccl`` where this process has CUDA, else ``gloo``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def local_host_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (no packet is sent): the interface
    gloo binds to and, on the trainer, the store's advertised host."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def start_store(towards: str, timeout_s: float) -> tuple[Store, str]:
    """A fresh TCP store on a free port (the trainer's, one per epoch) and the ``host:port``
    members reach it at (the address on the route to the replica at ``towards``)."""
    from torch.distributed import TCPStore

    host = local_host_towards(split_host(towards))
    store = TCPStore(host, 0, None, True, _delta(timeout_s), wait_for_workers=False)
    bracketed = f"[{host}]" if ":" in host else host
    return store, f"{bracketed}:{store.port}"


def connect_store(address: str, timeout_s: float) -> Store:
    """A member's client of the trainer's store."""
    from torch.distributed import TCPStore

    host, port = split_host(address), int(address.rsplit(":", 1)[1])
    return TCPStore(host, port, None, False, _delta(timeout_s))


def open_group(store: Store, spec: BroadcastGroup, host: str) -> ProcessGroup:
    """Join the epoch's group as ``spec.rank`` (blocks until every rank joined, at most
    ``timeout_s``); gloo binds to ``host``."""
    import torch.distributed as dist

    if spec.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _delta(spec.timeout_s)
        return dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = _delta(spec.timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, spec.rank, spec.world_size, options)


def broadcast(group: ProcessGroup, buffer: torch.Tensor, backend: str, timeout_s: float) -> None:
    """Rank 0's ``buffer`` (uint8, flat) into every other rank's, in place, one collective;
    raises when it fails or takes longer than ``timeout_s``."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    options.timeout = _delta(timeout_s)
    if backend != "nccl":
        group.broadcast([buffer], options).wait(_delta(timeout_s))
        return
    on_device = buffer.cuda()  # nccl: through the GPU (not run here)
    group.broadcast([on_device], options).wait(_delta(timeout_s))
    buffer.copy_(on_device.cpu())


def close_group(group: ProcessGroup | None) -> None:
    """Drop a group, aborting its pending work (a member may be gone)."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # noqa: BLE001, S110 - nothing left to save in a failed group
        pass


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
