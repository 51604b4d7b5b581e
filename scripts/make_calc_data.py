"""Write the agent job's calc data set (sums of 3 or 4 two-digit numbers) in verl's JSONL schema.

Why a script and not a download: the data is generated from a fixed seed, so anyone can rebuild
byte-identical files, and the committed copies stay small. The test split does not depend on
`--n-train`, so a bigger training set keeps the same held-out problems.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

# `python scripts/...` puts scripts/ on the import path: reuse the arith data script's writer.
from make_arith_data import write_jsonl

from rlfleet.tasks.calc import split_problems, to_verl_record

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/calc", help="output directory")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-test", type=int, default=500)
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    train, test = split_problems(args.seed, args.n_train, args.n_test)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, problems in (("train", train), ("test", test)):
        records = [to_verl_record(p, split, i) for i, p in enumerate(problems)]
        write_jsonl(out / f"{split}.jsonl", records)
        log.info("wrote %d %s problems to %s", len(records), split, out / f"{split}.jsonl")


if __name__ == "__main__":
    main()
