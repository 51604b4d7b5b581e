"""A role whose graceful stop hangs still exits after ``STOP_DEADLINE_S``, with every thread's
stack on stderr (CI once saw a role outlive its SIGKILLed launcher by more than 30 s)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

ROLE = """
import asyncio, sys, time
from rlfleet.common import grpc_server
grpc_server.STOP_DEADLINE_S = float(sys.argv[1])

async def main():
    stop = asyncio.Event()
    grpc_server.install_stop_signals(stop)
    loading = asyncio.create_task(asyncio.to_thread(time.sleep, 600))  # cannot be cancelled
    print("ready", flush=True)
    await stop.wait()
    loading.cancel()
    print("stopping", flush=True)

asyncio.run(main())  # joins the sleeping thread at exit: the hang
"""


def start_role(deadline_s: float) -> subprocess.Popen:
    role = subprocess.Popen(
        [sys.executable, "-c", ROLE, str(deadline_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert role.stdout.readline().strip() == "ready"
    return role


def test_a_hung_stop_ends_at_the_deadline_with_the_stacks():
    role = start_role(1.0)
    started = time.monotonic()
    role.send_signal(signal.SIGTERM)
    _, err = role.communicate(timeout=30)
    took = time.monotonic() - started
    assert role.returncode == 1
    assert 0.9 <= took < 15
    assert err.count("(most recent call first)") >= 2  # faulthandler's dump: both threads


def test_a_second_signal_does_not_push_the_deadline_back():
    role = start_role(3.0)
    started = time.monotonic()
    role.send_signal(signal.SIGTERM)
    time.sleep(2.5)
    role.send_signal(signal.SIGTERM)  # re-armed, it would end at 5.5 s
    role.communicate(timeout=30)
    assert role.returncode == 1
    assert time.monotonic() - started < 4.5
