"""scripts/check_sizes.py: the tree keeps its size limits, and each limit catches what it is for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_sizes.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_sizes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_sizes = load_checker()


def test_the_tree_keeps_its_size_limits():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def make_tree(root: Path, files: dict[str, str]) -> Path:
    services = root / "services"
    for name, text in files.items():
        path = services / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return services


def lines(count: int) -> str:
    return "".join(f"x{i} = {i}\n" for i in range(count))


def main_of(body_lines: int) -> str:
    return "def main():\n" + "".join(f"    y{i} = {i}\n" for i in range(body_lines - 1))


def test_limits_and_their_edges(tmp_path):
    services = make_tree(
        tmp_path,
        {
            "common/ok.py": lines(400),
            "common/big.py": lines(401),
            "proto/rollout_pb2_grpc.py": lines(900),
            "rollout/main.py": lines(61),
            "trainer/main.py": main_of(60),
            "trainer/cli.py": main_of(61),
        },
    )
    problems = check_sizes.check(services)
    assert len(problems) == 3, problems
    assert any("services/common/big.py: 401 lines" in p for p in problems)
    assert any("services/rollout/main.py: an entry point of 61 lines" in p for p in problems)
    assert any("services/trainer/cli.py:1: main() is 61 lines" in p for p in problems)


def test_an_allowed_file_passes_and_a_stale_entry_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(check_sizes, "ALLOWED", {"common/big.py": "why", "common/ok.py": "why"})
    services = make_tree(tmp_path, {"common/big.py": lines(401), "common/ok.py": lines(3)})
    problems = check_sizes.check(services)
    assert problems == [
        "scripts/check_sizes.py: ALLOWED entry 'common/ok.py' is within its limits (or gone); "
        "remove it"
    ]


def test_the_command_fails_on_a_violation(tmp_path):
    services = make_tree(tmp_path, {"common/big.py": lines(401)})
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(services)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "services/common/big.py: 401 lines" in result.stderr
