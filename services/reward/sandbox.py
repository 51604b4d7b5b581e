"""The parent side of the reward sandbox: start confined children, feed them, time them, kill them.

Why processes and not threads: a thread cannot be stopped, limited or kept off the network,
and user code that hangs, forks, allocates without bound or reads the service's secrets must
cost only its own item. Each child runs ``python -I -m rlfleet.reward.sandbox_child`` (which
confines itself before any user code runs; see that module for the layers) in a session of its
own, with an empty temporary directory as working directory and home, and an environment of a
few harmless variables. Past its wall clock the child's whole process group is SIGKILLed, and
after every program run the group is killed anyway, so nothing it started outlives it.

``run_program`` is one run of a program (the ``code`` scorer); ``SandboxProcess`` is a
long-lived child serving a user function (``sandbox_pool``). Neither raises for what the
child does: the outcome says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from rlfleet.common.config import SandboxLimits

CHILD_MODULE = "rlfleet.reward.sandbox_child"
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
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}  # fmt: skip


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        sig = signal.Signals(-returncode)
        return f"{SIGNAL_MEANING.get(sig, 'ended')} by {sig.name}"
    return f"exited with code {returncode}"


def limits_spec(limits: SandboxLimits) -> dict[str, Any]:
    return {"limits": limits.model_dump(), "parent_pid": os.getpid()}


async def spawn(mode: str, spec: dict[str, Any], workdir: str, stderr: int | None) -> Any:
    """A confined child in ``workdir``; stdin and stdout are pipes."""
    argv = [sys.executable, "-I", "-m", CHILD_MODULE, mode, json.dumps(spec)]
    return await asyncio.create_subprocess_exec(
        *argv, cwd=workdir, env=child_env(workdir), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=stderr, start_new_session=True, limit=LINE_LIMIT,
    )  # fmt: skip


def kill_group(process: Any) -> None:
    """SIGKILL the child's whole process group (its session: whatever it started too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def reap(process: Any) -> None:
    """Kill and wait. (asyncio's ``wait`` also waits for the pipes to close, which a killed
    child's do at once; the bound only guards against a pipe nobody drains.)"""
    kill_group(process)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), REAP_TIMEOUT_S)


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
    (cancellation kills it)."""
    with tempfile.TemporaryDirectory(prefix="rlfleet-sandbox-") as workdir:
        program = os.path.join(workdir, "main.py")
        with open(program, "w") as f:
            f.write(source)
        spec = {**limits_spec(limits), "program": program}
        process = await spawn("exec", spec, workdir, asyncio.subprocess.PIPE)
        try:
            return await _supervise(process, stdin.encode(), limits)
        finally:
            await reap(process)


async def _supervise(process: Any, stdin: bytes, limits: SandboxLimits) -> RunOutcome:
    cap = limits.output_kb * 1024
    feed = asyncio.create_task(_feed(process, stdin))
    reads = [_read_capped(stream, cap, process) for stream in (process.stdout, process.stderr)]
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
    return RunOutcome(code, out.decode(errors="replace"), err.decode(errors="replace"), reason)


async def _feed(process: Any, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            process.stdin.write(data)
            await process.stdin.drain()
        process.stdin.close()


async def _read_capped(stream: Any, cap: int, process: Any) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes, and whether there was more: then the run is killed, and the rest
    drained (asyncio's ``wait`` waits for the pipes to close)."""
    data, over = b"", False
    while chunk := await stream.read(1 << 16):
        if not over:
            data += chunk
            over = len(data) > cap
            if over:
                kill_group(process)
    return data[:cap], over


class SandboxError(RuntimeError):
    """A serving child could not answer a call (it died, or hung and was killed)."""


class SandboxProcess:
    """One long-lived confined child serving a user function: one JSON line in, one out."""

    def __init__(self, process: Any, workdir: tempfile.TemporaryDirectory, ready: dict) -> None:
        self.process, self._workdir, self.ready = process, workdir, ready

    @classmethod
    async def start(cls, user: dict[str, Any], limits: SandboxLimits) -> SandboxProcess:
        """Start and wait until the function is loaded; ValueError when it cannot be."""
        workdir = tempfile.TemporaryDirectory(prefix="rlfleet-sandbox-")
        spec = {**limits_spec(limits), "user": user}
        process = await spawn("serve", spec, workdir.name, None)
        child = cls(process, workdir, {})
        try:
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
            child.ready = json.loads(line) if line else {"error": describe_exit(process.returncode)}
        except BaseException:
            await child.close()
            raise
        if "error" in child.ready:
            await child.close()
            raise ValueError(f"user function {user['name']!r} did not load: {child.ready['error']}")
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
        return json.loads(line)

    async def close(self) -> None:
        await reap(self.process)
        self._workdir.cleanup()
