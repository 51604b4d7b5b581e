"""Helpers of the ``rlfleet_basic_math`` lm-evaluation-harness task.

The documents are the rows of ``<rlfleet cache>/data/basic_math/test.parquet`` (``RLFLEET_CACHE``,
else ``~/.cache/rlfleet``; ``--metadata '{"data_file": "..."}'`` names another file), in file
order, so ``--limit N`` scores the same first N rows as the trainer's ``data.val_size: N``. The
question is the row's user message as written; the server applies the model's chat template
(``--apply_chat_template``), as the trainer does. A response is right when
``rlfleet.tasks.basic_math.check`` says so: the reward service's own check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_basic_math(data_file: str | None = None, **_: Any) -> dict:
    import datasets

    from rlfleet.model.local_models import rlfleet_cache_dir

    path = Path(data_file).expanduser() if data_file else default_file(rlfleet_cache_dir())
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `make data-real` (basic_math)")
    return {"test": datasets.Dataset.from_parquet(str(path))}


def default_file(cache: Path) -> Path:
    return cache / "data" / "basic_math" / "test.parquet"


def doc_to_text(doc: dict) -> str:
    return doc["prompt"][0]["content"]


def doc_to_target(doc: dict) -> str:
    return str(doc["reward_model"]["ground_truth"])


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    from rlfleet.tasks.basic_math import check

    return {"acc": float(check(results[0], doc_to_target(doc)).correct)}
