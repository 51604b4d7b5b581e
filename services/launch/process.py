"""One role process of the fleet, whatever starts it (``rlfleet up`` locally, or a Ray actor
of ``rlfleet up --ray``): the command line and environment it gets, and ``RoleProcess``, which
starts it in a process group of its own and streams its output with a ``[name]`` prefix (and
into its log file). Both backends start the very same command, so a role behaves the same under either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.launch.screen import SCREEN


@dataclass
class RoleProcess:
    """One role's ``rlfleet VERB`` process, in a process group of its own."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    tail: list[str] = field(default_factory=list)

    def start(self, preexec_fn=None) -> None:
        proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
        self.proc = proc
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stdout) -> None:
        """Copy output to our stdout with a prefix (through ``SCREEN``, which keeps a progress
        bar apart from the lines) and into the log file, a bar's redraws as lines there; keep
        the last lines for error reports. Blank redraws (a bar being wiped) go nowhere."""
        prefix = f"[{self.name}] ".encode()
        with self.log_path.open("ab") as log:
            for text, end in _pieces(stdout):
                if self._show(prefix, text, end):
                    log.write(text + b"\n")
                    log.flush()
                    self.tail = (self.tail + [text.decode(errors="replace").rstrip()])[-15:]

    def _show(self, prefix: bytes, text: bytes, end: bytes) -> bool:
        """Hand one piece to the screen; True for what the log file and the tail keep: a
        line, or a finished redraw of a bar that is not blank."""
        if end == b"\n":
            SCREEN.line(self.name, prefix + text + b"\n")
            return True
        if not text.strip():  # a bar being wiped (tqdm, before a line is written above it)
            return False
        SCREEN.bar(self.name, prefix + text, finished=end == b"\r")
        return end == b"\r"

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # its own session: reaches vLLM's engine children
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL what is left of its process group (vLLM's engine core), exited or not."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def _pieces(stream):
    """``(text, end)`` pairs: text ended by ``\\n`` (a line) or ``\\r`` (a progress bar's
    redraw, finished once the next one begins); and, where a read stops inside a redraw, the
    redraw so far with end ``b""``, so a bar shows when drawn, not at its next redraw."""
    buffer, end = b"", b"\n"
    while chunk := stream.read1(4096):
        buffer += chunk
        while (cut := _first_break(buffer)) >= 0:
            end = buffer[cut : cut + 1]
            yield buffer[:cut], end
            buffer = buffer[cut + 1 :]
        if buffer and end == b"\r":
            yield buffer, b""
    if buffer:
        yield buffer, b"\n"


def _first_break(buffer: bytes) -> int:
    hits = [i for i in (buffer.find(b"\n"), buffer.find(b"\r")) if i >= 0]
    return min(hits) if hits else -1


def free_port() -> int:
    from rlfleet.common.ports import free_port as pick

    return pick()


QUIET_THREADS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Every role's torch threads sleep instead of spinning while they wait for work. The fleet
runs several torch processes on few cores (trainer, replicas, refcritic); spinning OpenMP
workers of an idle role steal the cores a busy one needs. Measured on the 2-core machine with
the rest of the machine busy: an actor update of 256 sequences took 2.5 s with spinning
threads and 0.5 s with passive ones (0.3 s with one thread)."""

LEAN_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
"""Every role's glibc malloc serves blocks of 1 MiB and more from their own mappings, returned
to the system when freed. By default glibc raises that threshold as big blocks are freed, so
the trainer's per-step activations and gradients land in its heaps and stay resident between
steps. Measured on SmolLM2-135M fp32 (an actor update of 64 rows of up to 128 tokens,
micro-batches of 8, 2-core machine): the trainer's peak RSS over a step 6.0 -> 5.3 GB and its
resident memory after a step 5.0 -> 3.1 GB, at the same step time within noise."""

ROLE_ENV_DEFAULTS = {**QUIET_THREADS, **LEAN_MALLOC}
"""What every role's environment gets unless the user's environment sets the same variable."""


def role_argv(
    verb: str, config_path: str | None, overrides: list[str], flags: tuple[str, ...] = ()
) -> list[str]:
    """The command line that starts one role: ``rlfleet VERB [--config FILE] FLAGS OVERRIDES``
    (flags such as ``--worker-only`` before the overrides: argparse takes no flag among them)."""
    config_args = ["--config", config_path] if config_path else []
    return [sys.executable, "-m", "rlfleet.cli", verb, *config_args, *flags, *overrides]


SECRET_SETTINGS = {
    "api_key": "RLFLEET_API_KEY",
    "redis_url": "RLFLEET_REDIS_URL",
    "redis_password": "RLFLEET_REDIS_PASSWORD",
}
"""Settings that never go on a role's command line, and the variable each travels in instead.
A command line is anyone's to read (``ps``, ``/proc/<pid>/cmdline``, and a user function in
the reward sandbox reading its parent's); a process's environment only its owner's (mode 0400).
The API key, the Redis password, and the Redis URL, which may hold it. The config reads both
variables (``ENV_OVERRIDES``) below the command line and above the YAML file, so a setting
moved here still wins over the file, as it did on the command line."""


def split_secrets(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """``overrides`` without the secret ones, and the environment that carries those. A
    secret set to null or empty (``api_key=null``: switch it off) carries nothing and stays."""
    from rlfleet.common.config.loading import split_override

    plain, secrets = [], {}
    for item in overrides:
        key, value = split_override(item)
        if key in SECRET_SETTINGS and value not in (None, ""):
            raw = item.partition("=")[2]  # the text as typed, unless YAML unquoted it
            secrets[SECRET_SETTINGS[key]] = value if isinstance(value, str) else raw
        else:
            plain.append(item)
    return plain, secrets


def role_env(redis_url: str, secrets: dict[str, str] | None = None) -> dict[str, str]:
    """Every role's environment: ours, ``ROLE_ENV_DEFAULTS`` unless the user chose, the
    secrets kept off its command line (``split_secrets``), Redis."""
    env = {**os.environ, **ROLE_ENV_DEFAULTS, "PYTHONUNBUFFERED": "1", **(secrets or {})}
    env.update({k: v for k, v in os.environ.items() if k in ROLE_ENV_DEFAULTS})  # the user's win
    env["RLFLEET_REDIS_URL"] = redis_url  # the launcher's (its embedded one, or the configured)
    return env
