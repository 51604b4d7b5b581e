"""The launcher's record of each role's peak memory (rlfleet.launch.peak_memory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from rlfleet.launch.peak_memory import PeakMemory, group_members, kib


def fake_process(proc: Path, pid: int, pgrp: int, name: str, hwm_kib: int) -> None:
    """A ``/proc/<pid>`` with the two files the recorder reads (a name with a space and a
    parenthesis, as ``comm`` may have)."""
    entry = proc / str(pid)
    entry.mkdir(parents=True)
    (entry / "stat").write_text(f"{pid} ({name}) S 1 {pgrp} {pgrp} 0 -1 4194560 0 0\n")
    (entry / "status").write_text(f"Name:\t{name}\nVmHWM:\t{hwm_kib} kB\nVmRSS:\t1 kB\n")


def test_a_roles_peak_is_its_largest_process_and_the_file_lists_each(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, os.getpid(), 1, "launcher", 10)  # the recorder checks /proc works
    fake_process(proc, 100, 100, "python", 1_000_000)  # trainer: ~0.95 GiB
    fake_process(proc, 200, 200, "python", 500_000)  # replica main
    fake_process(proc, 201, 200, "VLLM::Worker (x)", 3_000_000)  # its engine's worker
    fake_process(proc, 300, 300, "python", 9_000_000)  # not a role of ours
    peaks = PeakMemory(tmp_path / "peak_rss.json", proc=proc)

    peaks.sample({"trainer": 100, "rollout-0": 200}, force=True)

    record = json.loads((tmp_path / "peak_rss.json").read_text())
    assert record["peak_rss_GiB"] == {"trainer": 0.954, "rollout-0": 2.861}
    assert record["processes_GiB"]["rollout-0"] == {
        "python[200]": 0.477,
        "VLLM::Worker (x)[201]": 2.861,
    }
    assert peaks.summary_line() == "peak RSS (GiB): rollout-0 2.86, trainer 0.95"


def test_a_peak_is_kept_after_its_process_is_gone_and_only_grows(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, os.getpid(), 1, "launcher", 10)
    fake_process(proc, 100, 100, "python", 2_000_000)
    peaks = PeakMemory(tmp_path / "peak_rss.json", proc=proc)
    peaks.sample({"trainer": 100}, force=True)
    (proc / "100" / "status").unlink()  # exited between the samples
    (proc / "100" / "stat").unlink()
    peaks.sample({"trainer": 100}, force=True)
    assert peaks.by_role_gib() == {"trainer": 1.907}


def test_samples_are_spaced_unless_forced(tmp_path):
    proc = tmp_path / "proc"
    fake_process(proc, os.getpid(), 1, "launcher", 10)
    fake_process(proc, 100, 100, "python", 1000)
    peaks = PeakMemory(tmp_path / "peak_rss.json", proc=proc)
    peaks.sample({"trainer": 100})
    (proc / "100" / "status").write_text("Name:\tpython\nVmHWM:\t5000 kB\n")
    peaks.sample({"trainer": 100})  # within SAMPLE_EVERY_S of the first: not read
    assert peaks.peaks_kib["trainer"] == {"python[100]": 1000}
    peaks.sample({"trainer": 100}, force=True)
    assert peaks.peaks_kib["trainer"] == {"python[100]": 5000}


def test_kib_reads_kernel_sizes_and_missing_fields():
    assert kib("123 kB") == 123
    assert kib(None) == 0


def test_the_real_proc_sees_a_child_group_and_its_memory(tmp_path):
    """A child in a session of its own (as rlfleet up starts roles) that touches ~80 MB."""
    code = "b = bytearray(80 * 2**20); import sys; print('ok', flush=True); sys.stdin.read()"
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == b"ok"
        assert group_members([child.pid])[child.pid] == [child.pid]
        peaks = PeakMemory(tmp_path / "peak_rss.json")
        peaks.sample({"role": child.pid}, force=True)
        assert peaks.by_role_gib()["role"] > 80 / 1024
    finally:
        child.stdin.close()
        child.wait(timeout=10)
