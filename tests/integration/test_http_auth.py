"""The HTTP fronts with an API key (issue 19): ``/metrics``, ``/docs`` and ``/openapi.json``
need the key like every route but ``/healthz`` (a Prometheus scraper sends it as
``Authorization: Bearer``); without a key they stay open. Real router, reward and replica
processes (the replica's ``/metrics`` on ``rollout.metrics_port``)."""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from procs import ServiceProcess
from replica_proc import start_replica, stop_replica
from router_proc import router_argv, start_http_router

from rlfleet.common.redis_server import free_port

pytestmark = pytest.mark.slow

KEY = "s3cret-http"
GUARDED = ("/metrics", "/openapi.json", "/docs")


def status(url: str, key: str | None = None) -> tuple[int, str]:
    """(status, body text) of a GET, retrying briefly while the server starts."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for _ in range(100):
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers), timeout=30
            ) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except urllib.error.URLError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def assert_guarded(base: str, paths: tuple[str, ...]) -> None:
    for path in paths:
        assert status(base + path)[0] == 401, path
        assert status(base + path, "wrong")[0] == 401, path
        code, body = status(base + path, KEY)
        assert code == 200, (path, body[:300])
    assert status(base + "/healthz")[0] == 200  # probes need no key


def test_router_http_front_guards_metrics_and_docs_with_a_key(redis_url, keys, tmp_path):
    router = start_http_router(redis_url, keys, tmp_path / "router.log", f"api_key={KEY}")
    try:
        assert_guarded(router.http, (*GUARDED, "/v1/models"))
        code, page = status(router.http + "/docs", KEY)
        assert "swagger" in page.lower() and "/v1/chat/completions" in page  # the schema inline
        code, schema = status(router.http + "/openapi.json", KEY)
        assert "/v1/completions" in schema and "/openapi.json" not in schema
        assert "rlfleet_router" in status(router.http + "/metrics", KEY)[1]
    finally:
        router.proc.stop()


def test_router_without_a_key_keeps_them_open(redis_url, keys, tmp_path):
    router = start_http_router(redis_url, keys, tmp_path / "router.log")
    try:
        for path in GUARDED:
            assert status(router.http + path)[0] == 200, path
    finally:
        router.proc.stop()


def test_router_metrics_only_server_needs_the_key(redis_url, keys, tmp_path):
    metrics_port = free_port()
    argv = router_argv(
        redis_url,
        keys.cluster,
        free_port(),
        f"api_key={KEY}",
        f"router.metrics_port={metrics_port}",
    )
    router = ServiceProcess.start(argv, tmp_path / "router.log", "router")
    try:
        router.wait_for_line("router ready", 60)
        assert_guarded(f"http://127.0.0.1:{metrics_port}", GUARDED)
    finally:
        router.stop()


def test_reward_http_front_guards_metrics_and_docs_with_a_key(redis_url, keys, tmp_path: Path):
    http_port = free_port()
    argv = [
        sys.executable,
        "-m",
        "rlfleet.reward.main",
        f"cluster={keys.cluster}",
        f"redis_url={redis_url}",
        f"api_key={KEY}",
        f"reward.http_port={http_port}",
        "--port",
        str(free_port()),
    ]
    reward = ServiceProcess.start(argv, tmp_path / "reward.log", "reward")
    try:
        reward.wait_for_line("listening on port", 60)
        base = f"http://127.0.0.1:{http_port}"
        assert_guarded(base, (*GUARDED, "/v1/scorers"))
        assert "/v1/score/batch" in status(base + "/openapi.json", KEY)[1]
    finally:
        reward.stop()


def test_replica_metrics_need_the_key(redis_url, keys, tmp_path):
    port = free_port()
    replica = start_replica(
        redis_url,
        keys,
        "auth",
        tmp_path / "replica.log",
        "rollout.backend=hf",
        f"api_key={KEY}",
        f"rollout.metrics_port={port}",
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert status(url)[0] == 401 and status(url, "wrong")[0] == 401
        code, text = status(url, KEY)
        assert code == 200 and "rlfleet_rollout_weight_version" in text
    finally:
        stop_replica(replica)
