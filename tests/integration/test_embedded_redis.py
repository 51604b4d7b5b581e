"""The embedded server's life cycle: restarts on its port and data, and no server left behind.

Real ``valkey-server`` processes. The restart loop runs while other threads of this process
keep working (as gRPC's and a heartbeat's do in the services): the server is started with
``setpriv --pdeathsig`` in front, so no Python runs in a child between fork and exec (a
``preexec_fn`` there crashed with SIGSEGV under CI load).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
import redis

from rlfleet.common import pdeathsig
from rlfleet.common.redis_server import EmbeddedRedis


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not reaped yet) counts as gone
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_no_python_runs_between_fork_and_exec_where_setpriv_exists():
    prefix, preexec = pdeathsig.die_with_parent(signal.SIGTERM)
    if shutil.which("setpriv") is None:
        pytest.skip("no setpriv on this machine: the preexec_fn fallback is used")
    assert prefix[1:] == ["--pdeathsig", "TERM", "--"] and preexec is None


def test_restarts_keep_the_data_while_other_threads_run(tmp_path):
    stop = threading.Event()

    def busy() -> None:  # threads that allocate and lock while the server is forked
        while not stop.is_set():
            _ = [bytearray(4096) for _ in range(64)]

    workers = [threading.Thread(target=busy, daemon=True) for _ in range(4)]
    for worker in workers:
        worker.start()
    server = EmbeddedRedis(tmp_path / "redis", appendonly=True, fresh=True).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("kept", "yes")
        client.close()
        for _ in range(5):
            server.stop()
            server.start()
        client = redis.Redis.from_url(server.url)
        assert client.get("kept") == b"yes"
        client.close()
    finally:
        stop.set()
        server.stop()


def test_the_server_dies_with_the_thread_that_started_it(tmp_path):
    started: list[EmbeddedRedis] = []
    thread = threading.Thread(
        target=lambda: started.append(EmbeddedRedis(tmp_path / "redis", appendonly=False).start())
    )
    thread.start()
    thread.join()
    server = started[0]
    pid = server._proc.pid
    try:
        assert wait_gone(pid, 10.0), "the server outlived the thread that started it"
    finally:
        server.stop()
