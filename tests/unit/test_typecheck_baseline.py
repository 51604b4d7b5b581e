"""scripts/typecheck.py: mypy's lines become baseline keys without line numbers, and the
baseline only shrinks (a new error fails; a listed one that is gone fails until ``--shrink``).
mypy itself is not run here: ``make typecheck`` (in ``make lint`` and ``make test``) runs it."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "typecheck.py"
ERROR = 'services/x.py:12: error: Item "None" of "A | None" has no attribute "b"  [union-attr]'
OTHER = 'services/y.py:3: error: Need type annotation for "c"  [var-annotated]'


@pytest.fixture
def typecheck(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("typecheck_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "BASELINE", tmp_path / "baseline.txt")
    return module


def test_a_key_has_the_path_the_code_and_the_message_but_no_line(typecheck):
    assert typecheck.key(ERROR) == (
        'services/x.py: [union-attr] Item "None" of "A | None" has no attribute "b"'
    )
    moved = ERROR.replace(":12:", ":40:")
    assert typecheck.key(moved) == typecheck.key(ERROR)


def test_new_errors_fail_and_gone_ones_fail_until_the_baseline_shrinks(typecheck, monkeypatch):
    typecheck.write_baseline(Counter([typecheck.key(ERROR), typecheck.key(OTHER)]))
    found = [ERROR, OTHER]
    monkeypatch.setattr(typecheck, "run_mypy", lambda: found)
    assert typecheck.main([]) == 0
    found.append(ERROR.replace(":12:", ":14:"))  # a second error of the same kind: new
    assert typecheck.main([]) == 1
    found[:] = [ERROR]  # OTHER was fixed
    assert typecheck.main([]) == 1
    assert typecheck.main(["--shrink"]) == 0
    assert typecheck.read_baseline() == Counter([typecheck.key(ERROR)])
    found.append(OTHER)  # shrinking never took a new error in
    assert typecheck.main(["--shrink"]) == 1
    assert typecheck.read_baseline() == Counter([typecheck.key(ERROR)])
