"""The filesystem a sandbox sees: everything read-only but its own directory, and its own /proc.

Why at the mount level: the audit hook refuses Python's ``open`` for writing outside the
sandbox directory, but ``sqlite3``, a spawned shell or any native code write through the kernel
directly. In a private mount namespace (``isolation``, before capabilities are dropped) every
mount is remounted read-only, ``nosuid`` and ``nodev``; the sandbox directory is bound onto
itself first, so it alone stays writable; ``/dev/null`` and the other harmless devices are
bound the same way so they keep working on a ``nodev`` ``/dev``; ``/run`` and ``/dev/shm``
(service sockets, shared memory) are covered with an empty read-only tmpfs. ``/proc`` is
mounted anew for the sandbox's pid namespace, read-only: the service's processes, their
environment and argv are not in it. Nothing here touches the service's own mounts: the
namespace is private, and it dies with the sandbox.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 0x20, 0x400, 0x800, 0x1000
MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 0x4000, 0x40000, 0x200000, 0x1000000
KEPT_OPTIONS = {
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}
"""Per-mount options a remount must repeat (in a user namespace they are locked)."""
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
COVERED = ("/run", "/dev/shm")
LIBC = ctypes.CDLL(None, use_errno=True)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    def enc(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    if LIBC.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def confine_filesystem(workdir: str) -> tuple[bool, list[str], str]:
    """(all read-only but ``workdir``, the mounts left writable, what /proc is)."""
    workdir = os.path.realpath(workdir)
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we do here reaches the service
    keep = [workdir, *(device for device in DEVICES if os.path.exists(device))]
    for path in keep:
        mount(path, path, None, MS_BIND)
    for path in COVERED:
        if os.path.isdir(path) and not _within(workdir, path):
            with contextlib.suppress(OSError):
                mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    writable = [path for path, options in mount_points() if not _remount(path, options, workdir)]
    os.chdir(workdir)  # the old cwd is the directory under the bind mount: read-only now
    return not writable, writable, _own_proc()


def mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, its per-mount options) for every mount of this namespace."""
    points = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            points.append((_unescape(fields[4]), set(fields[5].split(","))))
    return points


def _unescape(path: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), path)


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _remount(path: str, options: set[str], workdir: str) -> bool:
    """Remount one mount point read-only (``workdir``: writable; a device: usable); False
    when it stays writable."""
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID
    flags |= sum(bit for name, bit in KEPT_OPTIONS.items() if name in options)
    if path != workdir:
        flags |= MS_RDONLY
    if path not in DEVICES:
        flags |= MS_NODEV
    try:
        mount(None, path, None, flags)
    except FileNotFoundError:
        return True  # under a covered directory: out of reach anyway
    except OSError:
        return "ro" in options
    return True


def _own_proc() -> str:
    """A read-only /proc of this pid namespace (``own``); an empty one (``hidden``) where the
    kernel refuses that; ``host`` if neither could be mounted."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY
    try:
        mount("proc", "/proc", "proc", flags)
        return "own"
    except OSError:
        pass
    try:
        mount("tmpfs", "/proc", "tmpfs", flags, "size=4k,mode=555")
        return "hidden"
    except OSError:
        return "host"
