"""The dashboard's pieces without a fleet: reading the run directory as it grows, the JSON
document and its API key, and the probe's view of a fleet whose roles are down (the addresses
probed have nobody listening). Its fallback to the replica registry on a real Redis:
tests/integration/test_dashboard_registry.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from fastapi.testclient import TestClient

from rlfleet.common.config import load_config
from rlfleet.common.redis_server import free_port
from rlfleet.dashboard import runfiles
from rlfleet.dashboard.app import create_app, replica_metrics_urls
from rlfleet.dashboard.probe import FleetProbe
from rlfleet.dashboard.state import DashboardState, time_left
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.rollout_batch import RolloutBatch
from rlfleet.trainer.samples import TrainSamples, prompt_text


def step_row(step: int, score: float, **extra) -> dict:
    return {
        "step": step,
        "training/global_step": float(step),
        "critic/score/mean": score,
        "actor/entropy": 0.5,
        "response_length/mean": 3.0,
        "timing_s/step": 0.5,
        "timing_s/gen": 0.3,
        "timing_s/update_actor": 0.1,
        **extra,
    }


def append(path, *rows: dict) -> None:
    with path.open("a") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)


def dead_config(tmp_path, **over):
    """A config whose every endpoint is a port nobody listens on."""
    ports = [free_port() for _ in range(4)]
    overrides = [
        f"run_dir={tmp_path}",
        f"endpoints.router=127.0.0.1:{ports[0]}",
        f"endpoints.reward=127.0.0.1:{ports[1]}",
        f"endpoints.refcritic=127.0.0.1:{ports[2]}",
        f"endpoints.trainer=127.0.0.1:{ports[3]}",
        "dashboard.probe_timeout_s=0.5",
    ]
    return load_config(None, overrides + [f"{k}={v}" for k, v in over.items()])


# ---- the run directory -------------------------------------------------------------------


def test_metrics_tail_reads_only_what_was_added_and_waits_for_a_whole_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = runfiles.MetricsTail(path)
    assert tail.read() == []  # no file yet
    append(path, step_row(1, 0.1), step_row(2, 0.2))
    with path.open("a") as handle:
        handle.write('{"step": 3, "training/global_step": 3.0, "critic/sc')  # torn write
    assert [r["step"] for r in tail.read()] == [1, 2]
    with path.open("a") as handle:
        handle.write('ore/mean": 0.3}\n{"step": 3, "val-core/arith/reward/mean@1": 0.5}\n')
    rows = tail.read()
    assert [r["step"] for r in rows] == [1, 2, 3, 3]
    assert rows[2]["critic/score/mean"] == 0.3


def test_metrics_tail_starts_a_new_series_when_a_new_run_begins(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = runfiles.MetricsTail(path)
    append(path, step_row(1, 0.1), step_row(2, 0.2), step_row(3, 0.3))
    assert len(tail.read()) == 3
    append(path, step_row(1, 0.9))  # a second run appended to the same file
    assert [(r["step"], r["critic/score/mean"]) for r in tail.read()] == [(1, 0.9)]
    path.unlink()
    append(path, step_row(1, 0.4), step_row(2, 0.5))  # a file made anew
    assert [r["critic/score/mean"] for r in tail.read()] == [0.4, 0.5]


def test_metrics_tail_keeps_the_rows_a_resumed_run_does_not_train_again(tmp_path):
    """A run killed after step 5 (checkpoint at step 3, a validation at step 2) resumes: its
    rows (``segment`` 1) replace steps 4-5 of the dead one and keep steps 1-3 and the
    validation, as the trainer's ``standing_rows`` does; a second resume does the same."""
    path = tmp_path / "metrics.jsonl"
    tail = runfiles.MetricsTail(path)
    validation = {"step": 2, "val-core/arith/reward/mean@1": 0.4}
    append(
        path,
        step_row(1, 0.1),
        step_row(2, 0.2),
        validation,
        step_row(3, 0.3),
        step_row(4, 0.4),
        step_row(5, 0.5),
    )
    assert len(tail.read()) == 6
    append(path, step_row(4, 0.41, segment=1, retrained=True))
    assert [(r["step"], r.get("critic/score/mean")) for r in tail.read()] == [
        (1, 0.1),
        (2, 0.2),
        (2, None),
        (3, 0.3),
        (4, 0.41),
    ]
    append(path, step_row(5, 0.51, segment=1, retrained=True), step_row(6, 0.6, segment=1))
    append(path, step_row(6, 0.61, segment=2, retrained=True))  # resumed again at step 5
    rows = tail.read()
    assert [r["step"] for r in rows] == [1, 2, 2, 3, 4, 5, 6]
    assert rows[-1]["critic/score/mean"] == 0.61
    fresh = runfiles.MetricsTail(path)  # a page opened later reads the same
    assert [(r["step"], r.get("segment", 0)) for r in fresh.read()] == [
        (r["step"], r.get("segment", 0)) for r in rows
    ]


def test_curves_pick_the_first_present_metric_and_validation_rows():
    rows = [
        step_row(1, 0.1, **{"actor/ppo_kl": 0.01}),
        step_row(2, 0.2, **{"actor/kl_loss": 0.5, "actor/ppo_kl": 0.02}),
        {"step": 2, "val-core/arith/reward/mean@1": 0.7, "training/time_s": 3.0},
    ]
    curves = runfiles.curves(rows, max_points=100)
    assert curves["reward"] == [[1, 0.1], [2, 0.2]]
    assert curves["kl"] == [[1, 0.01], [2, 0.5]]  # the loss term wins where it is logged
    assert curves["val:arith/reward/mean@1"] == [[2, 0.7]]
    assert curves["staleness"] == []


def test_thin_keeps_the_ends_and_the_limit():
    points = [[i, float(i)] for i in range(1000)]
    thinned = runfiles.thin(points, 50)
    assert len(thinned) == 50 and thinned[0] == [0, 0.0] and thinned[-1] == [999, 999.0]
    assert runfiles.thin(points[:10], 50) == points[:10]


def test_step_times_and_time_left():
    rows = [step_row(s, 0.1) for s in range(1, 31)]
    times = runfiles.step_times(rows, window=20)
    assert times["window"] == 20
    assert times["mean"]["generate"] == pytest.approx(0.3)
    assert times["mean"]["update"] == pytest.approx(0.1)
    assert times["mean"]["push"] == 0.0
    left = time_left(rows, total_steps=50, started_at=time.time())
    assert left["step"] == 30 and left["seconds_left"] == pytest.approx(10.0)
    assert time_left([], 50, time.time())["seconds_left"] is None


def test_tail_jsonl_returns_the_last_rows_of_a_long_file(tmp_path):
    path = tmp_path / "val_samples.jsonl"
    append(path, *({"step": i, "prompt": "x" * 50} for i in range(5000)))
    rows = runfiles.tail_jsonl(path, 3, block=4096)
    assert [r["step"] for r in rows] == [4997, 4998, 4999]
    assert runfiles.tail_jsonl(tmp_path / "missing.jsonl", 3) == []


# ---- training samples -------------------------------------------------------------------


def test_train_samples_writes_the_first_sample_of_the_first_groups(tmp_path):
    records = [
        PromptRecord(prompt=f"{g}+1=", data_source="arith", ground_truth=str(g + 1))
        for g in range(3)
        for _ in range(2)
    ]
    batch = RolloutBatch(
        records=records,
        group_ids=[0, 0, 1, 1, 2, 2],
        texts=["a", "b", "c", "d", "e", "f"],
        scores=[1.0, 0.0, 0.0, 1.0, 0.5, 0.5],
        weight_versions=[4] * 6,
        replica_ids=["r0", "r1"] * 3,
    )
    writer = TrainSamples(tmp_path / "train_samples.jsonl", per_step=2)
    writer.write(5, batch)
    rows = [
        json.loads(line) for line in (tmp_path / "train_samples.jsonl").read_text().splitlines()
    ]
    assert rows == [
        {
            "step": 5,
            "prompt": "0+1=",
            "response": "a",
            "score": 1.0,
            "weight_version": 4,
            "replica": "r0",
        },
        {
            "step": 5,
            "prompt": "1+1=",
            "response": "c",
            "score": 0.0,
            "weight_version": 4,
            "replica": "r0",
        },
    ]
    assert (
        prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]) == "q"
    )


# ---- the document and its key --------------------------------------------------------------


async def test_state_endpoint_serves_the_document_and_marks_dead_roles_down(tmp_path):
    append(tmp_path / "metrics.jsonl", step_row(1, 0.25), step_row(2, 0.5))
    append(
        tmp_path / "train_samples.jsonl",
        {"step": 2, "prompt": "1+1=", "response": "2", "score": 1.0},
    )
    config = dead_config(tmp_path, **{"trainer.total_steps": 10})
    state = DashboardState(config)
    await state.refresh()
    await state.close()
    body = TestClient(create_app(state, api_key=None)).get("/api/state").json()
    assert body["curves"]["reward"] == [[1, 0.25], [2, 0.5]]
    assert body["progress"]["step"] == 2 and body["progress"]["total_steps"] == 10
    assert body["samples"]["training"][0]["response"] == "2"
    roles = {r["name"]: r["up"] for r in body["fleet"]["roles"]}
    assert {"router", "reward", "trainer"} <= set(roles) and not any(roles.values())
    assert body["fleet"]["trainer"]["up"] is False
    assert body["fleet"]["replicas"] == []  # no router and no Redis: nothing is known
    assert body["fleet"]["replica_source"].startswith("unknown")
    assert body["config"]["total_steps"] == 10


@pytest.mark.parametrize("header", [None, "Bearer wrong", "secret", "Bearer secret2"])
def test_state_endpoint_refuses_a_missing_or_wrong_key_with_401_and_no_data(tmp_path, header):
    state = DashboardState(dead_config(tmp_path))
    state.document = {"curves": {"reward": [[1, 0.5]]}, "version": 1, "updated_at": time.time()}
    client = TestClient(create_app(state, api_key="secret"))
    reply = client.get("/api/state", headers={"Authorization": header} if header else {})
    assert reply.status_code == 401
    assert "curves" not in reply.text and "reward" not in reply.text
    ok = client.get("/api/state", headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200 and ok.json()["curves"]["reward"] == [[1, 0.5]]


def test_page_is_plain_html_with_no_outside_assets_and_no_data(tmp_path):
    state = DashboardState(dead_config(tmp_path, **{"dashboard.refresh_s": 0.5}))
    state.document = {"curves": {"reward": [[1, 0.123456]]}, "version": 1}
    page = TestClient(create_app(state, api_key="secret")).get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "const REFRESH_MS = 500;" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from outside
    assert "0.123456" not in page.text


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class CountingProbe:
    """Stands in for the fleet probe: counts how often the dashboard probed."""

    def __init__(self) -> None:
        self.calls = 0

    async def fleet(self) -> dict:
        self.calls += 1
        return {"roles": [], "replicas": []}

    async def close(self) -> None:
        pass


async def test_an_unread_dashboard_probes_nothing_and_a_reader_wakes_it(tmp_path):
    config = dead_config(tmp_path, **{"dashboard.refresh_s": 0.05, "dashboard.idle_after_s": 1.0})
    probe = CountingProbe()
    state = DashboardState(config, probe)
    loop = asyncio.create_task(state.run())
    try:
        await until(lambda: state.idle)  # no page open: the loop waits for a reader
        assert probe.calls == 0  # no probe, no file read
        append(tmp_path / "metrics.jsonl", step_row(1, 0.25))
        document = await state.latest()  # the first reader gets a fresh document at once
        assert document["curves"]["reward"] == [[1, 0.25]] and probe.calls == 1
        await until(lambda: probe.calls >= 3)  # while read, the loop refreshes every period
        await until(lambda: state.idle)  # idle_after_s without a reader: waiting again
        settled = probe.calls
        await asyncio.sleep(0)
        assert probe.calls == settled and state.idle
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


# ---- the probe against the registry --------------------------------------------------------


def test_replica_metrics_urls_come_from_the_launcher_entries():
    endpoints = {
        "rollout-0": {"metrics": "http://h:1/metrics"},
        "router": {"grpc": "h:2"},
        "rollout-1": {"grpc": "h:3"},
    }
    assert replica_metrics_urls(endpoints) == {"rollout-0": "http://h:1/metrics"}


async def test_probe_sees_a_role_up_at_once_when_it_comes_up_after_a_long_wait(tmp_path):
    """A trainer loads its model for a minute before its server starts. The probe's channel
    to it must not carry the reconnect backoff of all the failed looks (which drew a
    training trainer as "down UNAVAILABLE"): the first look after it starts sees it up."""
    from rlfleet.common.grpc_server import GrpcServer

    config = dead_config(tmp_path)
    trainer_address = config.endpoints.trainer
    probe = FleetProbe(config)
    server = GrpcServer([], "127.0.0.1", int(trainer_address.rsplit(":", 1)[1]))
    try:
        started = time.monotonic()
        while time.monotonic() - started < 8:  # ~16 looks: a shared channel backs off ~4 s
            fleet = await probe.fleet()
            assert not {r["name"]: r["up"] for r in fleet["roles"]}["trainer"]
            await asyncio.sleep(0.5)
        await server.start()
        fleet = await probe.fleet()
    finally:
        await probe.close()
        await server.stop(0)
    trainer = next(r for r in fleet["roles"] if r["name"] == "trainer")
    assert trainer["up"], trainer
