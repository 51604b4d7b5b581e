"""Regenerate docs/configuration.md's field tables ("Every field") from the config models.

Run after adding or changing a config field (a unit test fails while the page is out of date):
    python scripts/config_reference.py          # rewrite docs/configuration.md in place
    python scripts/config_reference.py --check  # exit 1 if docs/configuration.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args()
    from rlfleet.common.config.reference import replace_reference

    text = REFERENCE.read_text(encoding="utf-8")
    fresh = replace_reference(text)
    name = REFERENCE.relative_to(REFERENCE.parents[1])
    if args.check:
        print(f"{name} is up to date" if fresh == text else f"{name} is out of date")
        return int(fresh != text)
    REFERENCE.write_text(fresh, encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
