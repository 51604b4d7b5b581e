"""The parent side of the sandbox: start confined children, feed them, time them, kill them.

Why processes and not threads: a thread cannot be stopped, limited or kept off the network,
and user code that hangs, forks, allocates without bound or reads the service's secrets must
cost only its own call. Each child runs ``python -I -m rlfleet.common.sandbox.child`` (which
confines itself before any user code runs; see that module for the layers) in a session of its
own, in a pids cgroup of its own where the machine has one, with an empty temporary directory
as working directory and home, and an environment of a few harmless variables. The process we
start is the sandbox's keeper: SIGTERM makes it kill everything of the call, and it exits only
when that is dead; past the wall clock, and after every program run, that is what happens. What
comes back (output, errors, replies) is scrubbed of the service's secrets.

``run_program`` is one run of a program (the ``code`` scorer, sandboxed tools);
``SandboxProcess`` is a long-lived child serving calls through a handler (the reward role's
user-function pool). Neither raises for what the child does: the outcome says what happened.
``isolation_report`` says, once per process and in the log, what the kernel enforces here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.common.config import SandboxLimits
from rlfleet.common.sandbox import cgroup
from rlfleet.common.sandbox.scrub import scrub, scrub_tree

log = logging.getLogger(__name__)

CHILD_MODULE = "rlfleet.common.sandbox.child"
READY_TIMEOUT_S = 60.0
REAP_TIMEOUT_S = 5.0
LINE_LIMIT = 64 << 20  # longest reply line from a serving child
SIGNAL_MEANING = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGKILL: "killed (out of time, or out of memory)",
    signal.SIGSEGV: "crashed (segmentation fault)",
    signal.SIGABRT: "aborted",
}


def child_env(home: str) -> dict[str, str]:
    """All a child sees of the environment: nothing of ours (no keys, no Redis URL)."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "PYTHONIOENCODING": "utf-8",
    }


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            return f"ended by signal {-returncode}"
        return f"{SIGNAL_MEANING.get(sig, 'ended')} by {sig.name}"
    return f"exited with code {returncode}"


@dataclass
class Keeper:
    """A started sandbox: its keeper (what we signal and wait for) and its pids cgroup."""

    process: Any
    cgroup: Path | None

    def stop(self) -> None:
        """Ask the keeper to kill everything of the call (it exits once all of it is dead)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)

    async def reap(self) -> None:
        """Stop and wait; SIGKILL the session if the keeper does not answer; drop the cgroup.
        (asyncio's ``wait`` also waits for the pipes to close, which a dead call's do at
        once; the bound only guards against a pipe nobody drains.)"""
        self.stop()
        try:
            await asyncio.wait_for(self.process.wait(), REAP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.cgroup is not None:
            await cgroup.remove(self.cgroup)


async def spawn(
    mode: str, spec: dict[str, Any], limits: SandboxLimits, workdir: str, stderr: int | None
) -> Keeper:
    """A confined child in ``workdir``; stdin and stdout are pipes."""
    group = cgroup.create(limits.processes)
    spec = {
        **spec,
        "limits": limits.model_dump(),
        "parent_pid": os.getpid(),
        "workdir": workdir,
        "cgroup": str(group) if group else None,
    }
    argv = [sys.executable, "-I", "-m", CHILD_MODULE, mode, json.dumps(spec)]
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env=child_env(workdir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
            limit=LINE_LIMIT,
        )
    except BaseException:
        if group is not None:
            await cgroup.remove(group)
        raise
    return Keeper(process, group)


@dataclass
class RunOutcome:
    """What one program run did; ``reason`` is set when the sandbox stopped it."""

    returncode: int | None
    stdout: str
    stderr: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.reason


async def run_program(source: str, stdin: str, limits: SandboxLimits) -> RunOutcome:
    """Run ``source`` as a Python program in a fresh sandbox; never raises for what it does
    (cancellation kills it). Every process the program started is dead when this returns."""
    await isolation_report()
    with tempfile.TemporaryDirectory(prefix="rlfleet-sandbox-") as workdir:
        program = os.path.join(workdir, "main.py")
        with open(program, "w") as f:
            f.write(source)
        child = await spawn("exec", {"program": program}, limits, workdir, asyncio.subprocess.PIPE)
        try:
            return await _supervise(child, stdin.encode(), limits)
        finally:
            await child.reap()


async def _supervise(child: Keeper, stdin: bytes, limits: SandboxLimits) -> RunOutcome:
    process, cap = child.process, limits.output_kb * 1024
    feed = asyncio.create_task(_feed(process, stdin))
    reads = [_read_capped(stream, cap, child) for stream in (process.stdout, process.stderr)]
    reason = ""
    try:
        async with asyncio.timeout(limits.timeout_s):
            (out, over_out), (err, over_err) = await asyncio.gather(*reads)
            if over_out or over_err:
                reason = f"output over {limits.output_kb} KiB"
            await process.wait()
    except TimeoutError:
        out, err, reason = b"", b"", f"timed out after {limits.timeout_s:g}s"
    finally:
        feed.cancel()
    code = process.returncode
    if not reason and code is not None and code < 0:
        reason = describe_exit(code)
    return RunOutcome(
        code, scrub(out.decode(errors="replace")), scrub(err.decode(errors="replace")), reason
    )


async def _feed(process: Any, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            process.stdin.write(data)
            await process.stdin.drain()
        process.stdin.close()


async def _read_capped(stream: Any, cap: int, child: Keeper) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes, and whether there was more: then the run is killed, and the rest
    drained (asyncio's ``wait`` waits for the pipes to close)."""
    data, over = b"", False
    while chunk := await stream.read(1 << 16):
        if not over:
            data += chunk
            over = len(data) > cap
            if over:
                child.stop()
    return data[:cap], over


class SandboxError(RuntimeError):
    """A serving child could not answer a call (it died, or hung and was killed)."""


class SandboxProcess:
    """One long-lived confined child serving a handler: one JSON line in, one out."""

    def __init__(self, child: Keeper, workdir: tempfile.TemporaryDirectory, ready: dict) -> None:
        self.child, self._workdir, self.ready = child, workdir, ready
        self.process = child.process

    @classmethod
    async def start(
        cls, handler: str, payload: Mapping[str, Any], limits: SandboxLimits, label: str
    ) -> SandboxProcess:
        """Start ``handler`` (a module the child imports, see ``child.serve``) on ``payload``
        and wait until it is loaded; ValueError naming ``label`` when it cannot be."""
        workdir = tempfile.TemporaryDirectory(prefix="rlfleet-sandbox-")
        spec = {"handler": handler, "payload": payload}
        child = cls(await spawn("serve", spec, limits, workdir.name, None), workdir, {})
        try:
            line = await asyncio.wait_for(child.process.stdout.readline(), READY_TIMEOUT_S)
            exited: dict[str, Any] = {"error": describe_exit(child.process.returncode)}
            child.ready = scrub_tree(json.loads(line)) if line else exited
        except BaseException:
            await child.close()
            raise
        if "error" in child.ready:
            await child.close()
            raise ValueError(f"{label} did not load: {child.ready['error']}")
        _note(child.ready["isolation"])  # what a probe would find: no need for one
        return child

    async def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The child's reply; SandboxError when it dies or overruns ``timeout_s``."""
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        try:
            async with asyncio.timeout(timeout_s):
                await self.process.stdin.drain()
                line = await self.process.stdout.readline()
        except TimeoutError as exc:
            raise SandboxError(f"timed out after {timeout_s:g}s") from exc
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            await asyncio.wait_for(self.process.wait(), 5)
            raise SandboxError(describe_exit(self.process.returncode))
        await self._end_of_call()
        return scrub_tree(json.loads(line))

    async def _end_of_call(self) -> None:
        """Without a pid namespace the worker cannot kill what its call started (it does so
        itself inside one): the call's cgroup lists it, so kill that but keeper and worker."""
        own_pids = "pid" in self.ready.get("isolation", {}).get("namespaces", [])
        if self.child.cgroup is not None and not own_pids:
            spare = frozenset({self.process.pid, int(self.ready.get("pid", 0))})
            await cgroup.empty(self.child.cgroup, spare)

    async def close(self) -> None:
        await self.child.reap()
        self._workdir.cleanup()


_report: dict[str, Any] | None = None
_probing: asyncio.Future | None = None


async def isolation_report() -> dict[str, Any]:
    """What the kernel enforces for a sandbox on this machine, found once per process by a
    probe child (the same path every sandbox takes) and logged: one line that says which
    layers hold and, where they fall back, why. Concurrent first callers share one probe."""
    global _probing
    if _report is not None:
        return _report
    if _probing is None or _probing.get_loop() is not asyncio.get_running_loop():
        _probing = asyncio.ensure_future(_probe())
    _note(await asyncio.shield(_probing))
    return _report  # type: ignore[return-value]


def _note(report: dict[str, Any]) -> None:
    """Keep (and log) the first report this process gets, from a probe or a ready child."""
    global _report
    if _report is None:
        _report = report
        log.info("sandbox: %s", describe_isolation(report))


async def _probe() -> dict[str, Any]:
    limits = SandboxLimits(timeout_s=30)
    with tempfile.TemporaryDirectory(prefix="rlfleet-sandbox-") as workdir:
        child = await spawn("probe", {}, limits, workdir, asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(child.process.communicate(), limits.timeout_s)
        except TimeoutError:
            out, err = b"", b"probe timed out"
        finally:
            await child.reap()
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        return {
            "namespaces": [],
            "fallback": f"probe failed: {err.decode(errors='replace')[-300:]}",
        }


def describe_isolation(report: dict[str, Any]) -> str:
    """The probe's findings in one line."""
    spaces = report.get("namespaces") or []
    parts = [
        f"namespaces: {'+'.join(spaces) or 'none'}",
        f"pids cgroup: {'yes' if report.get('cgroup') else 'no'}",
        f"read-only filesystem: {'yes' if report.get('readonly') else 'no'}",
        f"/proc: {report.get('proc', 'host')}",
        f"capabilities dropped: {'no' if report.get('capabilities', True) else 'yes'}",
    ]
    if "pid" not in spaces:
        parts.append(f"FALLBACK, the audit hook and rlimits carry more: {report.get('fallback')}")
    elif "user" in spaces:
        parts.append("(through a user namespace)")
    return "; ".join(parts)
