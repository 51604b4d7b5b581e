"""One way for tests to start a real process, wait until it is ready, and stop it.

Why one helper: every integration test needs the same three steps, and each copy had its own
deadline, its own way to report a failed start and its own way to stop. Here a process gets
its own process group (so children it spawns, like vLLM's engine core, go with it), its output
goes to a log file whose last lines are shown whenever it fails to start, and stopping touches
only that process and its group: SIGTERM (or the signal asked for), then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rlfleet.common.grpc_healthcheck import check

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def clean_env(**extra: str) -> dict[str, str]:
    """Our environment without ``RLFLEET_*`` variables, so a child never finds a Redis or a
    cluster the test did not start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    return {**env, **extra}


@dataclass
class ServiceProcess:
    """A child process a test started, in its own process group, logging to ``log_path``."""

    popen: subprocess.Popen
    log_path: Path
    name: str

    @classmethod
    def start(
        cls, argv: Sequence[str], log_path: Path, name: str = "", env: dict[str, str] | None = None
    ) -> ServiceProcess:
        """Launch ``argv`` from the repository root; returns at once (see the ``wait_*``).
        Its run directory defaults to the log's folder, so nothing lands in the checkout."""
        env = clean_env(RLFLEET_RUN_DIR=str(log_path.parent)) if env is None else env
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return cls(popen, log_path, name or Path(argv[2] if len(argv) > 2 else argv[0]).name)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], T], timeout_s: float, what: str = "ready") -> T:
        """Poll ``ready()`` until it returns something truthy, and return that. Fails with the
        log's last lines if the process exits first or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if result := ready():
                return result
            if self.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.returncode}) before {what}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name} not {what} after {timeout_s} s:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def wait_for_line(self, text: str, timeout_s: float = 60) -> None:
        """Until ``text`` appears in the log (a readiness line the process prints)."""
        self.wait_until(lambda: text in self.log(), timeout_s, f"logging {text!r}")

    def wait_healthy(self, address: str, service: str, timeout_s: float = 120) -> None:
        """Until ``address`` answers the gRPC health check for ``service`` with SERVING."""
        self.wait_until(lambda: check(address, service, timeout_s=1.0)[0], timeout_s, "serving")

    def kill(self) -> None:
        """SIGKILL to this process only (its group is left to :meth:`stop`)."""
        if self.poll() is None:
            self.popen.kill()

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 20) -> int:
        """Send ``sig`` to our child, SIGKILL it if it lingers past ``grace_s``, then SIGKILL
        whatever it left in its process group. Returns the child's exit code."""
        if self.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        code = self.popen.wait()
        self._reap_group()
        return code

    def _reap_group(self, grace_s: float = 10) -> None:
        """Give the group's leftovers (engine children) a moment to exit, then SIGKILL them."""
        deadline = time.monotonic() + grace_s
        while _group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.pid):
            os.killpg(self.pid, signal.SIGKILL)


def start_and_wait(
    argv: Sequence[str], log_path: Path, ready: Callable[[ServiceProcess], object], name: str = ""
) -> ServiceProcess:
    """Start, then run ``ready(process)`` (one of the ``wait_*``); stopped if that fails."""
    process = ServiceProcess.start(argv, log_path, name)
    try:
        ready(process)
    except BaseException:
        process.stop(signal.SIGKILL)
        raise
    return process


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by someone else's process: not ours
        return False
    return True
