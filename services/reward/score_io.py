"""Rows in and out of ``rlfleet score``: JSONL or Parquet in verl's schema, and rows as requests.

verl's schema: ``data_source``, ``reward_model.ground_truth`` (or a top-level ``ground_truth``),
``extra_info``, and the response text under ``response``, or a list of them under
``responses`` (several samples of one prompt). A row becomes one request per response, with ids
``<row>`` or ``<row>:<k>``. Parquet is read in record batches, so a file of any size streams.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rlfleet.common.errors import InvalidArgument
from rlfleet.reward.types import ScoreRequest, ScoreResult

PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH_ROWS = 1024


def is_parquet(path: str) -> bool:
    return Path(path).suffix.lower() in PARQUET_SUFFIXES


def count_rows(path: str) -> int:
    if is_parquet(path):
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def read_rows(path: str) -> Iterator[tuple[int, dict]]:
    """(row number, row): JSONL line numbers, or Parquet row positions from 1."""
    if is_parquet(path):
        yield from _parquet_rows(path)
        return
    with open(path) as src:
        yield from jsonl_rows(src)


def jsonl_rows(src: IO[str]) -> Iterator[tuple[int, dict]]:
    """Every non-blank line; a line that is not a JSON object stops the run."""
    for line_no, line in enumerate(src, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise InvalidArgument(f"line {line_no} is not JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise InvalidArgument(f"line {line_no} is not a JSON object")
        yield line_no, row


def _parquet_rows(path: str) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def responses_of(row: dict, number: int, field: str | None) -> tuple[list[str], bool]:
    """The row's responses, and whether it holds a list of them (``responses``)."""
    name = field or ("responses" if "responses" in row else "response")
    if name not in row:
        raise InvalidArgument(f"row {number}: no {name!r} field (--response-field)")
    value = row[name]
    if isinstance(value, list | tuple):
        if not value or not all(isinstance(v, str) for v in value):
            raise InvalidArgument(f"row {number}: {name!r} must be a non-empty list of strings")
        return list(value), True
    return [value], False


def row_requests(
    row: dict, number: int, field: str | None, scorer: str | None
) -> tuple[list[ScoreRequest], bool]:
    """One checked request per response of a verl-schema row; and whether it has a list."""
    responses, many = responses_of(row, number, field)
    reward_model = row.get("reward_model") or {}
    truth = reward_model.get("ground_truth", row.get("ground_truth", ""))
    requests = [
        ScoreRequest(
            id=f"{number}:{k}" if many else str(number),
            data_source=str(row.get("data_source") or ""),
            solution_str=text,
            ground_truth=truth,
            extra_info=row.get("extra_info") or {},
            scorer=scorer,
        )
        for k, text in enumerate(responses)
    ]
    for request in requests:
        request.validate()
    return requests, many


@dataclass
class ScoredRow:
    """A row and its results (one per response; one error result when it made no request)."""

    number: int
    row: dict
    results: list[ScoreResult]
    many: bool

    @property
    def failed(self) -> bool:
        return any(result.error for result in self.results)

    def output(self, flat: bool = False) -> dict[str, Any]:
        """The row with ``score`` (a list ``scores`` for multi-response rows) and, when any,
        ``score_metrics``/``score_error``; ``flat`` (Parquet) always sets all three, metrics
        as JSON text, so every row has the same columns."""
        out = dict(self.row)
        scores = [r.score for r in self.results]
        metrics = [r.metrics for r in self.results]
        errors = [r.error for r in self.results]
        out["scores" if self.many else "score"] = scores if self.many else scores[0]
        metric, error = (metrics, errors) if self.many else (metrics[0], errors[0])
        if flat:
            flat_error = json.dumps(errors) if self.many else errors[0]
            return {**out, "score_metrics": json.dumps(metric), "score_error": flat_error}
        if any(metrics):
            out["score_metrics"] = metric
        if any(errors):
            out["score_error"] = error
        return out


class RowWriter:
    """JSONL written as rows come; Parquet collected and written once at ``close``."""

    def __init__(self, path: str) -> None:
        self.path, self.parquet = path, is_parquet(path)
        self._rows: list[dict] = []
        self._file = None if self.parquet else open(path, "w")  # noqa: SIM115 - closed in close

    def write(self, scored: ScoredRow) -> None:
        if self._file is None:
            self._rows.append(scored.output(flat=True))
        else:
            self._file.write(json.dumps(scored.output()) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(self._rows), self.path)
