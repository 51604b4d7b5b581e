"""``rlfleet data filter`` through a real fleet (router, an hf replica on the tiny arith model,
reward, Redis): started by the command itself, and a running one named by ``--run-dir``. The
kept rows carry their pass rate inside the band, and the counts add up; a data source no
scorer takes, and a band nothing falls in, end the command with exit code 2 and no output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from procs import ROOT, clean_env

from rlfleet.launch.serving import serving_fleet

pytestmark = pytest.mark.slow

CONFIG = str(ROOT / "configs" / "default.yaml")
FLEET = ["rollout.backend=hf"]
ROWS = [json.loads(line) for line in (ROOT / "data/arith/test.jsonl").read_text().splitlines()]


def prompts(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def data_filter(src: Path, dst: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "data",
        "filter",
        "--input",
        str(src),
        "--output",
        str(dst),
        "--config",
        CONFIG,
        "--k",
        "4",
        "--batch-size",
        "4",
        "--no-progress",
        *FLEET,
        *extra,
    ]
    return subprocess.run(
        argv, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=180
    )


@pytest.fixture(scope="module")
def run_dir(redis_server, tmp_path_factory) -> Iterator[Path]:
    """A running fleet on the test session's Redis, recorded in its run directory."""
    path = tmp_path_factory.mktemp("fleet")
    with serving_fleet(
        CONFIG, [*FLEET, f"redis_url={redis_server.url}", f"run_dir={path}"], wait_s=120
    ):
        yield path


def test_a_fleet_of_its_own_keeps_rows_in_the_band(tmp_path):
    src, dst = prompts(tmp_path, ROWS[:10]), tmp_path / "out.parquet"
    done = data_filter(src, dst, "--band", "0,0.5", f"run_dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    counts = [int(n) for n in re.findall(r"\d/4: (\d+)", done.stdout)]
    summary = re.search(r"(\d+) rows in, (\d+) sampled, (\d+) kept", done.stdout)
    assert summary and [int(g) for g in summary.groups()] == [10, 10, sum(counts[:3])]
    assert sum(counts) == 10
    kept = pq.read_table(dst).to_pylist()
    assert len(kept) == sum(counts[:3])
    for row in kept:
        assert 0.0 <= row["extra_info"]["pass_rate"] <= 0.5 and row["extra_info"]["pass_k"] == 4
        assert row["extra_info"]["split"] == "test" and row["data_source"] == "arith"
    assert pq.read_table(dst).schema.field("prompt") == pq.read_table(src).schema.field("prompt")


def test_a_data_source_without_a_scorer_is_refused(run_dir, tmp_path):
    rows = [*ROWS[:3], {**ROWS[3], "data_source": "no_such_task"}]
    dst = tmp_path / "out.parquet"
    done = data_filter(prompts(tmp_path, rows), dst, "--run-dir", str(run_dir))
    assert done.returncode == 2
    assert "no scorer for data_source 'no_such_task' (1 rows)" in done.stderr
    assert "histogram" not in done.stdout and not dst.exists()  # refused before sampling


def test_a_band_nothing_falls_in_names_the_band_and_the_histogram(run_dir, tmp_path):
    dst = tmp_path / "out.parquet"
    # no score reaches 2.0, so every pass rate is 0: outside [0.5, 1] whatever was sampled
    done = data_filter(
        prompts(tmp_path, ROWS[:6]),
        dst,
        "--run-dir",
        str(run_dir),
        "--band",
        "0.5,1",
        "--correct-at",
        "2",
    )
    assert done.returncode == 2
    assert "no prompt has a pass rate in the band [0.5, 1]" in done.stderr
    assert "0/4: 6  1/4: 0  2/4: 0  3/4: 0  4/4: 0" in done.stderr
    assert not dst.exists()
