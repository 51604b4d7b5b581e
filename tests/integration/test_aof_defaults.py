"""AOF is on by default wherever rlfleet runs Redis itself (issue 19: "AOF fixes it, but only
compose turns it on — not the embedded Redis of ``rlfleet up``, not deploy/k8s/redis.yaml").

With the append-only file (fsync every second) a Redis that crashes and restarts keeps its
queues, leases and answers; without it every restart is an empty one.
"""

from __future__ import annotations

from pathlib import Path

import redis
import yaml

from rlfleet.common.redis_server import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[2]


def test_the_embedded_server_keeps_its_data_across_a_restart_by_default(tmp_path: Path):
    server = EmbeddedRedis(tmp_path / "redis", fresh=True)  # as ``rlfleet up`` makes it
    command = server._command()
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "everysec"
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("kept", "yes")
        client.close()
        server.stop()
        server.start()
        client = redis.Redis.from_url(server.url)
        assert client.get("kept") == b"yes"
        client.close()
    finally:
        server.stop()


def test_the_k8s_redis_runs_with_aof_everysec():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "redis.yaml").read_text()))
    deployment = next(d for d in docs if d and d.get("kind") == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "everysec"
