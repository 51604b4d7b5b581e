"""scripts/check_layers.py: the tree keeps its layers, and each rule catches what it is for."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_layers.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


check_layers = load_checker()


def test_the_tree_keeps_its_layers():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "the layers hold" in result.stdout


def make_tree(root: Path, files: dict[str, str]) -> Path:
    """A small ``services/`` tree: every folder a package, ``files`` as given."""
    services = root / "services"
    for name, text in files.items():
        path = services / name
        for folder in [path.parent, *path.parent.parents]:
            if folder == root:
                break
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").touch()
        path.write_text(text, encoding="utf-8")
    return services


CLEAN = {
    "common/errors.py": "class Oops(Exception): ...\n",
    "model/load.py": "import torch\nfrom rlfleet.common.errors import Oops\n",
    "reward/client.py": "from rlfleet.common import errors\n",
    "reward/scorers.py": "def score(): ...\n",
    "trainer/run.py": "from rlfleet.reward.client import *\nfrom rlfleet.model import load\n",
    "launch/up.py": "from rlfleet.trainer import run\n",
}

VIOLATIONS = [
    (
        {"common/config.py": "from rlfleet.trainer import run\n"},
        "services/common/config.py:1: rlfleet.common.config imports rlfleet.trainer.run",
        "arrows point down",
    ),
    (
        {"trainer/fit.py": "def f():\n    from rlfleet.reward.scorers import score\n"},
        "services/trainer/fit.py:2: rlfleet.trainer.fit imports rlfleet.reward.scorers",
        "roles meet only through clients and protos",
    ),
    (
        {"common/tensors.py": "def f():\n    import torch\n"},
        "services/common/tensors.py:2",
        "common must not import torch",
    ),
    (
        {"model/a.py": "from rlfleet.model import b\n", "model/b.py": "from . import a\n"},
        "rlfleet.model.a, rlfleet.model.b",
        "import cycle at import time",
    ),
    (
        {
            "model/a.py": "from rlfleet.model import b\n",
            "model/b.py": "def f():\n    from . import a\n",
        },
        "rlfleet.model.a, rlfleet.model.b",
        "import cycle through lazy imports",
    ),
    (
        {
            "model/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from rlfleet.model.b import B\n",
            "model/b.py": "from rlfleet.model.a import f\nclass B: ...\n",
        },
        "rlfleet.model.a, rlfleet.model.b",
        "import cycle through type-only imports",
    ),
    (
        {
            "tasks/x.py": "from rlfleet.rl import y\n",
            "rl/y.py": "def f():\n    import rlfleet.tasks\n",
        },
        "rl, tasks",
        "packages import each other",
    ),
    (
        {
            "rollout/gateway/app.py": "from rlfleet.rollout.router import core\n",
            "rollout/router/core.py": "def generate(): ...\n",
        },
        "services/rollout/gateway/app.py:1: rlfleet.rollout.gateway.app imports "
        "rlfleet.rollout.router.core",
        "rlfleet.rollout.gateway may not import rlfleet.rollout.router",
    ),
    (
        {"gateway/main.py": "from rlfleet.common import errors\n"},
        "services/gateway/main.py",
        "'gateway' is in no layer",
    ),
]


@pytest.mark.parametrize(("extra", "where", "rule"), VIOLATIONS)
def test_a_violation_names_the_file_and_the_rule(tmp_path, extra, where, rule):
    services = make_tree(tmp_path, {**CLEAN, **extra})
    problems = check_layers.check(services)
    assert any(where in line and rule in line for line in problems), problems


def test_a_clean_tree_passes_and_the_command_fails_on_a_violation(tmp_path):
    services = make_tree(tmp_path, CLEAN)
    assert check_layers.check(services) == []
    make_tree(tmp_path, {"common/config.py": "import rlfleet.launch.up\n"})
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(services)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "services/common/config.py:1" in result.stderr
    assert "arrows point down" in result.stderr


def test_an_exception_no_import_needs_any_more_is_reported(tmp_path):
    """The env role's exception for rlfleet.agent, in a tree where env no longer uses agent."""
    services = make_tree(tmp_path, {**CLEAN, "env/worker.py": "", "agent/loop.py": ""})
    problems = check_layers.check(services)
    assert any("ROLE_EXCEPTIONS entry ('rlfleet.env', 'rlfleet.agent')" in p for p in problems)


LAZY_PAIR = {
    "model/a.py": "def f():\n    from rlfleet.model import b\n",
    "model/b.py": "def g():\n    from rlfleet.model import a\n",
}


def test_a_listed_lazy_cycle_passes_and_one_that_is_gone_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(
        check_layers, "LAZY_CYCLES", {("rlfleet.model.a", "rlfleet.model.b"): "why"}
    )
    assert check_layers.check(make_tree(tmp_path, {**CLEAN, **LAZY_PAIR})) == []
    services = make_tree(tmp_path, {"model/b.py": "def g(): ...\n"})
    problems = check_layers.check(services)
    assert any("LAZY_CYCLES entry ('rlfleet.model.a', 'rlfleet.model.b')" in p for p in problems)


def test_lazy_and_type_checking_imports_make_no_start_up_cycle_but_a_type_only_one(tmp_path):
    services = make_tree(
        tmp_path,
        {
            **CLEAN,
            "model/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from rlfleet.model import b\n",
            "model/b.py": "def f():\n    from rlfleet.model import a\n",
        },
    )
    problems = check_layers.check(services)
    assert len(problems) == 1, problems
    assert (
        "import cycle through type-only imports among rlfleet.model.a, rlfleet.model.b"
        in problems[0]
    )
