"""Weight payloads in shared memory, for replicas on the trainer's own machine.

Why: over gRPC every replica receives its own copy of the bytes (sent, copied through the
kernel, received, written into a buffer), so on a small machine pushing to 4 replicas cost ~6x
pushing to one. Replicas on the trainer's host can instead read one file in ``/dev/shm``: the
trainer encodes the weights straight into it (the one copy it makes anyway), and the header,
sent over ``Rollout.UpdateWeights`` as always, names the file instead of being followed by data
chunks. Each replica maps the file copy-on-write (no copy until its engine copies the tensors
into its parameters), checks size and checksum as for streamed bytes, and loads.

A replica that cannot see the file (another machine, a container with its own ``/dev/shm``)
answers NOT_FOUND before any weight changes, and the trainer streams the bytes to it from
then on. Files are named ``rlfleet-w-<trainer pid>-<random>``: the trainer removes each one
when its push is over, and removes files left by trainers that died (their pid is gone, and
the file is older than any push takes) when its transport starts. Replicas open only names of that shape, inside ``/dev/shm``.
"""

from __future__ import annotations

import mmap
import os
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.common.errors import InvalidArgument, NotFound

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "rlfleet-w-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]{{32}}$")
ORPHAN_AGE_S = 600.0
"""A file is only an orphan this long after it was written (a trainer in another PID
namespace sharing ``/dev/shm`` would look dead)."""


def available() -> bool:
    """Whether this machine has a shared-memory filesystem to put payloads in."""
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedPayload:
    """The trainer's side: one payload file, mapped writable while a push writes it, removed by
    ``close``. OSError when ``/dev/shm`` has no room for it (containers get 64 MiB by default).

    ``unmap`` drops the trainer's mapping and keeps the file (a spare for the next push): its
    pages then stop counting in the trainer's resident memory, which a mapped spare would hold
    through the whole next update (0.54 GB for SmolLM2-135M in fp32)."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        self.path = SHM_DIR / self.name
        self.nbytes = nbytes
        self._map: mmap.mmap | None = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:  # reserve the pages now: a full /dev/shm is an OSError here, not a
                os.posix_fallocate(fd, 0, nbytes)  # SIGBUS when a page is first written
                self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def tensor(self) -> torch.Tensor:
        """The whole file as a uint8 tensor (writes go straight to the shared pages); maps the
        file again after ``unmap``."""
        import torch

        if not self.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        if self._map is None:
            fd = os.open(self.path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, self.nbytes)
            finally:
                os.close(fd)
        return torch.frombuffer(self._map, dtype=torch.uint8)

    def drop_pages(self) -> None:
        """Stop holding the written pages in this process (``MADV_DONTNEED`` on a shared
        file mapping: the bytes stay in the file and fault back in if read again), so a push
        in flight does not count in the trainer's resident memory while it trains on."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def unmap(self) -> None:
        """Drop this process's mapping, keep the file (unmapped once the last tensor viewing
        it is gone)."""
        self._map = None

    def close(self) -> None:
        """Remove the file; replicas that still map it keep their pages until they unmap."""
        self.path.unlink(missing_ok=True)
        self._map = None  # unmapped once the last tensor viewing it is gone


def open_shared(name: str, total_bytes: int) -> memoryview:
    """A replica's view of the payload file ``name``, mapped copy-on-write (writable, so
    tensors can view it without a copy; writes would stay private). NotFound if this machine
    has no such file, InvalidArgument for a name that is not a payload's or a wrong size."""
    if not _NAME.match(name):
        raise InvalidArgument(f"shared-memory weights: {name!r} is not a payload file name")
    try:
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
    except FileNotFoundError:
        raise NotFound(
            f"shared-memory weights {name!r} are not on this machine "
            f"(the replica is not on the trainer's host)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size != total_bytes:
            raise InvalidArgument(
                f"shared-memory weights hold {size} bytes, the header announced {total_bytes}"
            )
        if not size:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)


def remove_orphans(min_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Remove payload files whose trainer process is gone (it died mid-push); their names."""
    removed, now = [], time.time()
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        match = _NAME.match(path.name)
        if match and not _alive(int(match.group(1))) and _age_s(path, now) >= min_age_s:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _age_s(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True
