"""The test tree itself: pytest imports test modules by basename (no packages under tests/),
so two files with one name in tests/unit and tests/integration break collection, but only
when `-n 2 --dist loadfile` happens to give both to one worker. Checked here every run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_name_of_its_own():
    names = Counter(path.name for path in TESTS.glob("*/test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
