"""The trainer's malloc settings: where glibc puts the big blocks an update frees.

Why: a training step allocates and frees gigabytes of activations and gradients. glibc serves
blocks above its mmap threshold from mappings of their own, which go back to the system when
freed; the rest comes from its heaps, which keep freed memory resident and fragment. The
threshold starts at 128 KiB and *rises* (up to 32 MiB) each time a mapped block is freed, so
after the first step most activations land in the heaps and the trainer's peak RSS grows step
after step. Fixing it (``mallopt(M_MMAP_THRESHOLD)`` also stops the rise) keeps the peak at
what the step needs.

oneDNN (bf16 matmuls on CPU) JIT-compiles a kernel per shape and keeps up to 1,024 of them in
its primitive cache, 256-512 KiB of code each; a trainer whose micro-batches change length
every step fills it: 0.53 GiB of the SmolLM2 recipe's trainer, 4,300 kernel buffers, after 80
steps. ``limit_onednn_cache`` keeps fewer; the rows change shape each micro-batch anyway, so a
smaller cache compiles no more often (same update time in an update-only probe; docs/real_model.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

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


ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def limit_onednn_cache(capacity: int) -> None:
    """At most ``capacity`` compiled oneDNN kernels kept; 0, or the variable already set by the
    user, leaves oneDNN's default. Takes effect when called before the process's first oneDNN
    primitive (oneDNN reads the variable once, when its cache is made)."""
    if capacity > 0:
        os.environ.setdefault(ONEDNN_CACHE_VARIABLE, str(capacity))


def lean_native_memory(mmap_threshold_kib: int, onednn_cache_capacity: int) -> None:
    """Both settings above, for a process about to train (before its first oneDNN kernel)."""
    set_mmap_threshold(mmap_threshold_kib)
    limit_onednn_cache(onednn_cache_capacity)
