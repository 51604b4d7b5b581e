"""Write the default job's addition data set in verl's JSONL schema.

Why a script and not a download: the data is generated from a fixed seed, so anyone can rebuild
byte-identical files, and the committed copies stay small.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

# Run from a clean checkout (no `pip install -e .`): put the repo root on the import path.
from rlfleet.tasks.arith import split_problems, to_verl_record

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/arith", help="output directory")
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--digits", type=int, default=2, help="operand digits (0..10**d-1)")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def write_jsonl(path: Path, records: list[dict]) -> None:
    """One compact JSON object per line, keys in a fixed order so reruns are byte-identical."""
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, separators=(",", ":")) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    train, test = split_problems(args.seed, args.n_train, args.n_test, args.digits)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, problems in (("train", train), ("test", test)):
        records = [to_verl_record(p, split, i) for i, p in enumerate(problems)]
        write_jsonl(out / f"{split}.jsonl", records)
        log.info("wrote %d %s problems to %s", len(records), split, out / f"{split}.jsonl")


if __name__ == "__main__":
    main()
