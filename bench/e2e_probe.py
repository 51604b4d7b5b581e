"""What the end-to-end benchmark samples from outside a running fleet, without touching its code.

Why from outside: the fleet's processes keep no counters of their own for CPU time, Redis
commands or bytes on the wire, and a benchmark that needs patched services measures something
else. So this reads the operating system and Redis directly:

- CPU seconds per process (psutil), labelled by rlfleet verb (``trainer``, ``rollout-0``, ...);
  helper processes (vLLM's engine core) count towards the verb of their nearest ancestor.
- Redis commands by name (``INFO commandstats``) and Redis network bytes (``INFO stats``).
- Bytes on the fleet's TCP listening sockets (the kernel's per-socket ``tcp_info`` counters via
  ``ss -tin``), per service; HTTP/2 and TLS framing included. gRPC *calls* are not counted
  anywhere (no interceptor exposes them), so they are not reported.

A :class:`Snapshot` taken at two steps of a run gives per-step rates by subtraction.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field

import psutil

_SS_BYTES = re.compile(r"\bbytes_(sent|received):(\d+)")


@dataclass
class Snapshot:
    """Cumulative counters at one moment of a run."""

    t: float
    step: int
    cpu_s: dict[str, float] = field(default_factory=dict)
    redis_calls: dict[str, int] = field(default_factory=dict)
    redis_net: dict[str, int] = field(default_factory=dict)
    tcp: dict[str, dict[str, int]] = field(default_factory=dict)


def label_of(proc: psutil.Process) -> str | None:
    """``trainer``, ``rollout-0``, ``up``... for a ``python -m rlfleet.cli <verb>`` process."""
    try:
        argv = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "rlfleet.cli" not in argv or argv.index("rlfleet.cli") + 1 >= len(argv):
        return None
    verb = argv[argv.index("rlfleet.cli") + 1]
    replica = next((a.split("=", 1)[1] for a in argv if a.startswith("rollout.replica_id=")), None)
    return replica or verb


class ProcessTree:
    """CPU seconds of a process and all its descendants, kept after a process has exited."""

    def __init__(self, root_pid: int, extra: dict[int, str] | None = None) -> None:
        self.root = psutil.Process(root_pid)
        self.extra = extra or {}
        self.labels: dict[int, str] = {}
        self.cpu: dict[int, float] = {}
        self.listen: dict[int, str] = {}

    def processes(self) -> list[psutil.Process]:
        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        return tree + [p for pid in self.extra if (p := _process(pid)) is not None]

    def sample(self) -> dict[str, float]:
        """Refresh every live process's CPU time; CPU seconds per label so far."""
        for proc in self.processes():
            label = self._label(proc)
            try:
                times = proc.cpu_times()
                self.cpu[proc.pid] = times.user + times.system
                self._note_listening(proc, label)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        totals: dict[str, float] = {}
        for pid, seconds in self.cpu.items():
            totals[self.labels[pid]] = totals.get(self.labels[pid], 0.0) + seconds
        return totals

    def _label(self, proc: psutil.Process) -> str:
        if proc.pid not in self.labels:
            self.labels[proc.pid] = (
                self.extra.get(proc.pid) or label_of(proc) or self._inherited(proc)
            )
        return self.labels[proc.pid]

    def _inherited(self, proc: psutil.Process) -> str:
        try:
            parent = proc.parent()
        except psutil.NoSuchProcess:
            parent = None
        if parent is None or parent.pid == proc.pid:
            return proc.name()
        return self._label(parent)

    def _note_listening(self, proc: psutil.Process, label: str) -> None:
        for conn in proc.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr:
                self.listen[conn.laddr.port] = label


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def tcp_bytes(listen: dict[int, str]) -> dict[str, dict[str, int]]:
    """Bytes received and sent by the server side of every connection to ``listen``'s ports."""
    try:
        out = subprocess.run(
            ["ss", "-tinH", "state", "established"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    totals: dict[str, dict[str, int]] = {}
    local_port = None
    for line in out.splitlines():
        if not line[:1].isspace():
            local_port = _local_port(line)
            continue
        label = listen.get(local_port)
        if label is not None:
            into = totals.setdefault(label, {"received": 0, "sent": 0})
            for kind, value in _SS_BYTES.findall(line):
                into[kind] += int(value)
    return totals


def _local_port(header: str) -> int | None:
    parts = header.split()
    try:
        return int(parts[2].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def redis_counters(client) -> tuple[dict[str, int], dict[str, int]]:
    """Calls per command (``INFO`` itself left out) and the server's network byte counters."""
    stats = client.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    calls.pop("info", None)
    net = client.info("stats")
    keys = ("total_net_input_bytes", "total_net_output_bytes")
    return calls, {k: int(net.get(k, 0)) for k in keys}


def snapshot(tree: ProcessTree, redis_client, step: int) -> Snapshot:
    cpu = tree.sample()
    calls, net = redis_counters(redis_client)
    return Snapshot(time.perf_counter(), step, cpu, calls, net, tcp_bytes(tree.listen))


def per_step(before: Snapshot, after: Snapshot) -> dict:
    """Rates between two snapshots, divided by the trainer steps between them."""
    steps = max(after.step - before.step, 1)

    def delta(a: dict, b: dict) -> dict:
        return {k: (b.get(k, 0) - a.get(k, 0)) / steps for k in b if b.get(k, 0) != a.get(k, 0)}

    calls = delta(before.redis_calls, after.redis_calls)
    tcp = {label: delta(before.tcp.get(label, {}), counts) for label, counts in after.tcp.items()}
    return {
        "steps": steps,
        "wall_s_per_step": (after.t - before.t) / steps,
        "cpu_s_per_step": delta(before.cpu_s, after.cpu_s),
        "redis_commands_per_step": sum(calls.values()),
        "redis_calls_per_step": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
        "redis_net_bytes_per_step": delta(before.redis_net, after.redis_net),
        "tcp_bytes_per_step": tcp,
    }
