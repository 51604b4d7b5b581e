"""Secrets never on any role's command line (issue 19), checked on the real processes.

`rlfleet up` is given an API key the worst way (`api_key=...` on its own command line) and a
Redis URL with a password (`RLFLEET_REDIS_URL`, for a server of the test's own that requires
it). While it trains a step, every process below the launcher (each role, and whatever a role
starts) is read from `/proc/<pid>/cmdline`: none holds the key or the password. The roles do
get both: the run needs the password to reach Redis and the key for every RPC (each server
refuses calls without it), and it finishes; the router's environment carries the key.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import redis
from procs import ServiceProcess, clean_env
from up_proc import up_argv

from rlfleet.common.redis_server import EmbeddedRedis

pytestmark = pytest.mark.slow

KEY = f"sk-argv-{uuid.uuid4().hex[:12]}"
PASSWORD = f"pw{uuid.uuid4().hex[:12]}"
ROLES = {"router", "rollout", "reward", "trainer"}


def descendants(root: int) -> dict[int, list[str]]:
    """Every live process below ``root``: pid -> its command line."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        todo += children.get(pid, [])
    return {pid: line.split("\0") for pid, line in found.items()}


def role_of(argv: list[str]) -> str | None:
    """``rollout`` for ``python -m rlfleet.cli rollout ...``; None for other processes."""
    return argv[argv.index("rlfleet.cli") + 1] if "rlfleet.cli" in argv[:8] else None


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.partition("=")[::2] for item in raw.split("\0") if "=" in item)


@pytest.fixture
def locked_redis(tmp_path):
    """A Redis of our own that refuses clients without ``PASSWORD``; its URL with it."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
        yield f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"


def test_no_role_gets_the_key_or_the_redis_password_on_its_command_line(tmp_path, locked_redis):
    run_dir = tmp_path / "run"
    argv = up_argv(
        run_dir,
        "hf",
        1,
        [f"api_key={KEY}", "trainer.val_before_train=false", "data.val_size=4", "rollout.n=2"],
    )
    argv[argv.index("--rollout-replicas") + 1] = "1"
    up = ServiceProcess.start(
        argv, tmp_path / "up.log", "rlfleet up", clean_env(RLFLEET_REDIS_URL=locked_redis)
    )
    seen: dict[int, list[str]] = {}
    try:
        while up.poll() is None:
            for pid, line in descendants(up.pid).items():
                role = role_of(line)
                if role == "up":  # the user's own command, or a child between fork and exec
                    continue
                if pid not in seen and role == "router":
                    assert environ(pid).get("RLFLEET_API_KEY") == KEY
                seen.setdefault(pid, line)
            time.sleep(0.2)
        assert up.returncode == 0, up.log_tail(60)
    finally:
        up.stop()
    assert ROLES <= {role_of(line) for line in seen.values()}, seen
    for pid, line in seen.items():
        text = " ".join(line)
        assert KEY not in text and PASSWORD not in text, (pid, text)
    log = up.log()
    assert KEY not in log and PASSWORD not in log  # nor printed by any role
    assert os.path.isfile(run_dir / "summary.json")
