"""``set_mmap_threshold``: after it, a block above the threshold is a mapping of its own, not
a piece of malloc's heap (checked in a child process, so this one's malloc is left alone)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlfleet.model.heap import set_mmap_threshold

CHILD = """
import ctypes, sys
from rlfleet.model.heap import set_mmap_threshold
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] != "0":
    assert set_mmap_threshold(int(sys.argv[1]))
address = libc.malloc(100 * 1024)  # below glibc's default threshold (128 KiB), above 64
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    low, high = (int(x, 16) for x in span.split("-"))
    if low <= address < high:
        print(rest[-1] if len(rest) == 5 else "anonymous")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize(("kib", "where"), [(0, "[heap]"), (64, "anonymous")])
def test_a_block_above_the_threshold_gets_its_own_mapping(kib: int, where: str):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(kib)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [where]


def test_zero_leaves_malloc_alone():
    assert set_mmap_threshold(0) is False


def test_the_onednn_cache_limit_is_set_unless_the_user_chose(monkeypatch):
    from rlfleet.model.heap import ONEDNN_CACHE_VARIABLE, limit_onednn_cache

    monkeypatch.delenv(ONEDNN_CACHE_VARIABLE, raising=False)
    limit_onednn_cache(0)
    assert ONEDNN_CACHE_VARIABLE not in os.environ
    limit_onednn_cache(16)
    assert os.environ[ONEDNN_CACHE_VARIABLE] == "16"
    monkeypatch.setenv(ONEDNN_CACHE_VARIABLE, "512")
    limit_onednn_cache(16)
    assert os.environ[ONEDNN_CACHE_VARIABLE] == "512"
