"""A few rows of ``configs/agent_calc.yaml``'s training file, for the short agent runs.

Why: the trainer reads and tokenizes every training row before its first step, and the
shipped file has 20,000 (about 1.7 CPU-s per ``rlfleet up``, on two shared cores, once per
fleet); a two-step run of two tasks draws four. The rows are the file's first ones, as they
are (the same mix of three- and four-number sums), so the episodes are the job's own tasks.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

from procs import ROOT

CALC_TRAIN = ROOT / "data" / "calc" / "train.jsonl"
ROWS = 64


def calc_train_rows(directory: Path, rows: int = ROWS) -> Path:
    """The first ``rows`` rows of the calc training file, written to ``directory``."""
    target = directory / "calc_train.jsonl"
    with CALC_TRAIN.open(encoding="utf-8") as source:
        target.write_text("".join(islice(source, rows)), encoding="utf-8")
    return target


def train_files_override(path: Path) -> str:
    """``data.train_files`` naming only ``path`` (a JSON list: any path parses as one string)."""
    return f"data.train_files={json.dumps([str(path)])}"
