"""Regenerate README.md's "Configuration reference" tables from the config models.

Run after adding or changing a config field (a unit test fails while README is out of date):
    python scripts/config_reference.py          # rewrite README.md in place
    python scripts/config_reference.py --check  # exit 1 if README.md is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, write nothing")
    args = parser.parse_args()
    from rlfleet.common.config.reference import replace_reference

    text = README.read_text(encoding="utf-8")
    fresh = replace_reference(text)
    if args.check:
        print("README.md is up to date" if fresh == text else "README.md is out of date")
        return int(fresh != text)
    README.write_text(fresh, encoding="utf-8")
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
