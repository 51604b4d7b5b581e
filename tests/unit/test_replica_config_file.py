"""Each replica records its resolved config in a file of its own, with the id it runs under.

Before: a replica started without ``--replica-id`` generated its id after the config had been
recorded, so every such replica (``docker compose --scale``, a k8s Deployment) wrote the same
``run_dir/config.rollout.yaml``, each overwriting the last, with ``replica_id: null``.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rlfleet.rollout.main import parse

BASE = ["--port", "0", "redis_url=redis://127.0.0.1:1"]


def recorded(run_dir: Path) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in run_dir.glob("config.*.yaml")}


def test_replicas_started_without_an_id_each_record_their_own_file(tmp_path: Path):
    ids = [parse([*BASE, f"run_dir={tmp_path}"]).rollout.replica_id for _ in range(3)]
    assert len(set(ids)) == 3 and all(rid and rid.startswith("rollout-") for rid in ids)
    files = recorded(tmp_path)
    assert "config.rollout.yaml" not in files
    assert sorted(files) == sorted(f"config.{rid}.yaml" for rid in ids)
    for rid in ids:  # the file holds the id the process runs under
        assert files[f"config.{rid}.yaml"]["rollout"]["replica_id"] == rid


def test_an_id_from_the_config_or_the_flag_is_kept(tmp_path: Path):
    assert (
        parse([*BASE, f"run_dir={tmp_path}", "rollout.replica_id=cfg-a"]).rollout.replica_id
        == "cfg-a"
    )
    assert (
        parse([*BASE, f"run_dir={tmp_path}", "--replica-id", "flag-b"]).rollout.replica_id
        == "flag-b"
    )
    assert sorted(recorded(tmp_path)) == ["config.cfg-a.yaml", "config.flag-b.yaml"]
