"""Keep the prompts a model solves sometimes: a difficulty filter by sampled pass rate.

Why: GRPO learns only from groups whose samples disagree. A prompt the policy always solves
(pass rate 1) or never solves (0) gives every sample the same advantage, zero signal, and
still costs a full group of generations. prime-rl ships "perfectible" subsets for this reason;
``rlfleet data filter`` makes one for any verl-schema file: sample ``k`` answers per prompt
from the model, score them, and keep the rows whose pass rate ``p = correct / k`` lies in a
band (``low <= p <= high``, default 0.2-0.8), with ``p`` written into ``extra_info``.

This module is the filter without the fleet: rows are plain dicts in verl's schema, and the
samples come from a ``Judge`` (a callable that answers ``k`` scores per row), so the same code
runs against the router and reward service (``rlfleet.launch.data_filter``) and against a
fake in unit tests. Parquet is read and written with pyarrow, keeping every input column (and
its type) as it was; only ``extra_info`` gains ``pass_rate`` and ``pass_k``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Judge = Callable[[Sequence[Any]], Awaitable[list[list[float]]]]
"""Scores of the ``k`` sampled answers to each item (a row, or what the caller made of it) of
a batch, in order."""

EPSILON = 1e-9
"""Slack in band comparisons, so ``2/10`` counts as inside a band that starts at ``0.2``."""


@dataclass(frozen=True)
class Band:
    """The pass rates kept, both ends included."""

    low: float = 0.2
    high: float = 0.8

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ValueError(f"band {self} must satisfy 0 <= low <= high <= 1")

    @classmethod
    def parse(cls, text: str) -> Band:
        """``"0.2,0.8"`` -> ``Band(0.2, 0.8)``."""
        parts = text.split(",")
        try:
            low, high = (float(part) for part in parts)
        except ValueError:
            raise ValueError(
                f"band {text!r} must be two numbers, LOW,HIGH (e.g. 0.2,0.8)"
            ) from None
        return cls(low, high)

    def contains(self, rate: float) -> bool:
        return self.low - EPSILON <= rate <= self.high + EPSILON

    def __str__(self) -> str:
        return f"[{self.low:g}, {self.high:g}]"


class EmptyBand(ValueError):
    """No row's pass rate lies in the band (the message names the band and the histogram)."""


def pass_rates(score_groups: Iterable[Sequence[float]], correct_at: float = 1.0) -> list[float]:
    """Each row's fraction of answers scored at least ``correct_at`` (full credit, by default:
    a format bonus alone is no pass)."""
    rates = []
    for scores in score_groups:
        if not scores:
            raise ValueError("a row came back with no sampled answers")
        rates.append(sum(score >= correct_at for score in scores) / len(scores))
    return rates


def histogram(rates: Iterable[float], k: int) -> list[int]:
    """How many rows passed 0, 1, ..., ``k`` of their ``k`` answers (index = correct count)."""
    counts = [0] * (k + 1)
    for rate in rates:
        counts[round(rate * k)] += 1
    return counts


def format_histogram(counts: Sequence[int]) -> str:
    """``0/4: 3  1/4: 0  2/4: 5  3/4: 1  4/4: 2``: rows per pass-rate bucket."""
    k = len(counts) - 1
    return "  ".join(f"{correct}/{k}: {count}" for correct, count in enumerate(counts))


def keep_in_band(rows: Sequence[dict], rates: Sequence[float], band: Band, k: int) -> list[int]:
    """Indices of the rows whose pass rate lies in ``band``; ``EmptyBand`` when there are none."""
    if len(rows) != len(rates):
        raise ValueError(f"{len(rows)} rows but {len(rates)} pass rates")
    kept = [index for index, rate in enumerate(rates) if band.contains(rate)]
    if not kept:
        raise EmptyBand(
            f"no prompt has a pass rate in the band {band} ({len(rows)} rows, k={k}); "
            f"pass-rate histogram: {format_histogram(histogram(rates, k))}. "
            "Widen --band, or sample more answers (--k)"
        )
    return kept


def with_pass_rate(row: dict, rate: float, k: int) -> dict:
    """``row`` with ``extra_info.pass_rate`` and ``extra_info.pass_k`` (a copy)."""
    extra = dict(row.get("extra_info") or {})
    return {**row, "extra_info": {**extra, "pass_rate": rate, "pass_k": k}}


def unscored_sources(
    rows: Iterable[dict], known: Collection[str], takes_any: bool = False
) -> dict[str, int]:
    """Data sources of ``rows`` no scorer takes, with their row counts (``{}``: all scored).
    ``takes_any``: a default scorer takes every data source."""
    missing: dict[str, int] = {}
    for row in rows:
        source = str(row.get("data_source") or "")
        if not takes_any and source not in known:
            missing[source] = missing.get(source, 0) + 1
    return missing


def check_scored(rows: Iterable[dict], known: Collection[str], takes_any: bool = False) -> None:
    """Refuse rows no scorer can score (before any sampling), naming their data sources."""
    missing = unscored_sources(rows, known, takes_any)
    if missing:
        named = ", ".join(f"{source!r} ({count} rows)" for source, count in missing.items())
        raise ValueError(f"no scorer for data_source {named}; scorers take: {sorted(known)}")


def problem_key(row: dict) -> str:
    """What makes two rows the same problem: the text the model is asked (the last user
    message of a chat prompt), as ``scripts/prepare_data.py`` keeps train and test apart."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    users = [
        m.get("content") for m in prompt or () if isinstance(m, dict) and m.get("role") == "user"
    ]
    return str(users[-1]) if users else json.dumps(prompt, sort_keys=True, default=str)


def without_problems(rows: Sequence[dict], held_out: Iterable[dict]) -> list[int]:
    """Indices of the rows whose problem is not among ``held_out``'s, so a filtered train set
    never shares a problem with the held-out set."""
    seen = {problem_key(row) for row in held_out}
    return [index for index, row in enumerate(rows) if problem_key(row) not in seen]


class Progress(Protocol):
    def update(self, n: int) -> object: ...


async def measure(
    items: Sequence[Any],
    judge: Judge,
    batch_size: int,
    correct_at: float = 1.0,
    progress: Progress | None = None,
) -> list[float]:
    """Every item's pass rate, ``batch_size`` items per ``judge`` call (never one per item)."""
    rates: list[float] = []
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        scores = await judge(batch)
        if len(scores) != len(batch):
            raise ValueError(f"the judge answered {len(scores)} rows of {len(batch)}")
        rates += pass_rates(scores, correct_at)
        if progress is not None:
            progress.update(len(batch))
    return rates


def read_table(path: str | Path) -> Any:
    """A verl-schema ``.parquet`` (or JSONL) file as a ``pyarrow.Table``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"input file not found: {path}")
    if path.suffix == ".parquet":
        return pq.read_table(path)
    with path.open(encoding="utf-8") as handle:
        return pa.Table.from_pylist([json.loads(line) for line in handle if line.strip()])


def write_kept(table: Any, kept: Sequence[int], rates: Sequence[float], k: int, path: Path) -> None:
    """Rows ``kept`` of ``table`` (with their pass ``rates``, in the same order), every column
    as it was but ``extra_info``, which gains ``pass_rate`` and ``pass_k``, to ``path``
    (Parquet; JSONL unless named ``.parquet``), through a side file: no reader sees half."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chosen = table.take(pa.array(kept, type=pa.int64()))
    extras = [
        with_pass_rate({"extra_info": extra}, rate, k)["extra_info"]
        for extra, rate in zip(_extra_infos(chosen), rates, strict=True)
    ]
    column = pa.array(extras)
    if "extra_info" in chosen.column_names:
        chosen = chosen.set_column(chosen.column_names.index("extra_info"), "extra_info", column)
    else:
        chosen = chosen.append_column("extra_info", column)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".parquet":
        pq.write_table(chosen, staging)
    else:
        staging.write_text("".join(json.dumps(r, default=str) + "\n" for r in chosen.to_pylist()))
    staging.replace(path)


def _extra_infos(table: Any) -> list[dict]:
    if "extra_info" not in table.column_names:
        return [{} for _ in range(table.num_rows)]
    return [dict(extra or {}) for extra in table.column("extra_info").to_pylist()]
