"""``rlfleet score`` against a real reward service: JSONL and Parquet in verl's schema,
multi-response rows, the per-``data_source`` table, the progress bar, and the exit code."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from procs import ServiceProcess

from rlfleet.common.redis_server import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ROWS = [
    {
        "data_source": "arith",
        "responses": ["12", "13", "12"],
        "reward_model": {"ground_truth": "12"},
    },
    {"data_source": "arith", "response": "7", "reward_model": {"ground_truth": "7"}},
    {
        "data_source": "openai/gsm8k",
        "response": "so #### 5",
        "reward_model": {"ground_truth": "5"},
        "extra_info": {"index": 3},
    },
    {"data_source": "openai/gsm8k", "response": "#### 4", "reward_model": {"ground_truth": "5"}},
]


@pytest.fixture
def address(redis_url, cluster_name, tmp_path) -> Iterator[str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "rlfleet.reward.main",
        f"cluster={cluster_name}",
        f"redis_url={redis_url}",
        "--port",
        str(port),
    ]
    proc = ServiceProcess.start(argv, tmp_path / "reward.log", "reward")
    try:
        proc.wait_for_line("listening on port", 60)
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop(signal.SIGKILL)


def score(address: str, src: Path, dst: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "score",
            "--input",
            str(src),
            "--output",
            str(dst),
            "--address",
            address,
            "--batch-size",
            "2",
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_jsonl_with_multi_response_rows(address, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    done = score(address, src, dst)
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert out[0]["scores"] == [1.0, 0.0, 1.0] and "score" not in out[0]
    assert [row["score"] for row in out[1:]] == [1.0, 1.0, 0.0]
    assert out[2]["score_metrics"]["acc"] == 1.0 and out[2]["extra_info"] == {"index": 3}
    table = done.stdout.splitlines()
    assert table[0].split() == ["data_source", "rows", "failed", "mean_score"]
    assert table[1].split() == ["arith", "2", "0", "0.7500"]  # 3 of 4 responses right
    assert table[2].split() == ["openai/gsm8k", "2", "0", "0.5000"]
    assert "4 rows: mean score 0.6667 over 6 scored, 0 errors" in done.stdout
    assert "row/s" in done.stderr or "it/s" in done.stderr or "100%" in done.stderr  # the bar


def test_parquet_in_and_out_and_failed_rows_exit_nonzero(address, tmp_path):
    rows = [*ROWS, {"data_source": "nope", "response": "1", "reward_model": {"ground_truth": "1"}}]
    rows = [{**row, "responses": row.get("responses", [row.get("response")])} for row in rows]
    rows = [{k: v for k, v in row.items() if k != "response"} for row in rows]
    src, dst = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    done = score(address, src, dst, "--no-progress")
    assert done.returncode == 1
    assert "1 rows failed" in done.stderr
    out = pq.read_table(dst).to_pylist()
    assert [row["scores"] for row in out] == [[1.0, 0.0, 1.0], [1.0], [1.0], [0.0], [0.0]]
    assert "no scorer for data_source 'nope'" in out[4]["score_error"]
    assert json.loads(out[2]["score_metrics"])[0]["acc"] == 1.0
    assert "nope" in done.stdout.splitlines()[2]
