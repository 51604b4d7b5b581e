"""docs/configuration.md's field reference is generated from the config models and kept current."""

from __future__ import annotations

from pathlib import Path

from rlfleet.common.config import describe_fields
from rlfleet.common.config.reference import BEGIN, END, first_sentence, markdown_reference

ROOT = Path(__file__).resolve().parents[2]


def test_docs_reference_is_current():
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    block = page[page.index(BEGIN) : page.index(END) + len(END)]
    assert block == markdown_reference(), (
        "docs/configuration.md's configuration reference is out of date: "
        "run python scripts/config_reference.py"
    )


def test_readme_links_the_reference():
    """The README no longer holds the tables, but a newcomer still finds them from it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert BEGIN not in readme
    assert "docs/configuration.md" in readme


def test_every_field_and_choice_has_a_row():
    reference = markdown_reference()
    rows = [line for line in reference.splitlines() if line.startswith("| `")]
    assert len(rows) == len(describe_fields())  # the same fields --help-config lists
    for row in (
        "| `adv_estimator` | `grpo` | `grpo` / `rloo` /",
        "| `kl_ctrl.type` | `fixed` |",
        "| `apply_chat_template` | `auto` | `auto` / `true` / `false`.",
    ):
        assert row in reference, row


def test_first_sentence_keeps_abbreviations_and_turns_rst_into_markdown():
    doc = """Resources, e.g. ``{a: 1}``, as in Dr. GRPO
    (see ``x``). Second sentence."""
    assert first_sentence(doc) == "Resources, e.g. `{a: 1}`, as in Dr. GRPO (see `x`)."
