"""scripts/multihost_test.py's verdict on a finished run, from the files a run leaves (the run
itself needs root, namespaces and Ray: `make multihost-test`). A run that did what the test is
for passes; each way of not doing it is named."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
from script_modules import load_script

mh = load_script("multihost_test")

HEAD, W1, W2 = "198.51.100.10", "198.51.100.11", "198.51.100.12"


def finished_run(tmp_path, replicas=(W1, W2), streamed=(W1, W2), steps=3, offered_file=False):
    """The files of a run whose replicas started on ``replicas`` and to whose addresses
    ``streamed`` the trainer streamed its weights."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    (run_dir / "logs").mkdir(parents=True)
    logs.mkdir()
    placed = {name: {"node_ip": HEAD} for name in ("router", "reward", "trainer")}
    placed |= {f"rollout-{i}": {"node_ip": ip} for i, ip in enumerate(replicas)}
    (run_dir / "ray_placement.json").write_text(json.dumps(placed))
    metrics = [{"step": s, "timing_s/step": 0.5} for s in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    fleet = [
        f"(RoleActor) [ray] rollout-{i} started on node {ip} (actor pid 1, role pid 2)"
        for i, ip in enumerate(replicas)
    ]
    (logs / "fleet.log").write_text("\n".join(fleet) + "\n")
    trainer = [f"INFO replica at {ip}:4000 is not on this host: streaming" for ip in streamed]
    if offered_file:
        trainer.append("INFO replica rollout-1 cannot read shared memory (NotFound): streaming")
    (run_dir / "logs" / "trainer.log").write_text("\n".join(trainer) + "\n")
    return SimpleNamespace(run_dir=run_dir, logs=logs, args=SimpleNamespace(steps=3))


def ok() -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], 0)


def test_a_run_that_did_it_all_passes(tmp_path):
    assert mh.check_run(finished_run(tmp_path), ok()) == []


@pytest.mark.parametrize(
    ("run", "named"),
    [
        ({"replicas": (W1, W1)}, "both replicas started on one host"),
        ({"replicas": (HEAD, W2)}, "rollout-0 did not start on a worker host"),
        ({"streamed": (W1,)}, "the trainer streamed to"),
        ({"offered_file": True}, "offered a replica shared memory"),
        ({"steps": 2}, "steps done [1, 2]"),
    ],
)
def test_each_way_of_missing_the_point_is_named(tmp_path, run, named):
    problems = mh.check_run(finished_run(tmp_path, **run), ok())
    assert any(named in problem for problem in problems), problems


def test_a_failed_launcher_is_named_with_its_output(tmp_path):
    problems = mh.check_run(finished_run(tmp_path), subprocess.CompletedProcess([], 1))
    assert problems and problems[0].startswith("rlfleet up exited 1")
