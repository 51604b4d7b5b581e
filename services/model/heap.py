"""The trainer's malloc settings: where glibc puts the big blocks an update frees.

Why: a training step allocates and frees gigabytes of activations and gradients. glibc serves
blocks above its mmap threshold from mappings of their own, which go back to the system when
freed; the rest comes from its heaps, which keep freed memory resident and fragment. The
threshold starts at 128 KiB and *rises* (up to 32 MiB) each time a mapped block is freed, so
after the first step most activations land in the heaps and the trainer's peak RSS grows step
after step. Fixing it (``mallopt(M_MMAP_THRESHOLD)`` also stops the rise) keeps the peak at
what the step needs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (malloc.h)."""


def set_mmap_threshold(kib: int) -> bool:
    """Blocks of ``kib`` KiB and more are served from their own mappings from now on; 0 leaves
    malloc alone. False (and a WARNING) where this is not glibc or it refuses the value."""
    if kib <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        applied = bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(kib * 1024)))
    except (OSError, AttributeError) as exc:  # musl, macOS: no mallopt
        log.warning("malloc's mmap threshold left as it is: %s", exc)
        return False
    if not applied:
        log.warning("malloc refused an mmap threshold of %d KiB", kib)
    return applied
