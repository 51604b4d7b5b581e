"""``rlfleet score``: score a JSONL file of responses through the reward service.

Rows use verl's schema (``data_source``, ``reward_model.ground_truth``, ``extra_info``) plus the
response text under ``--response-field``. Each output row is the input row with ``score`` added
(and ``score_metrics`` / ``score_error`` when there are any), in input order. The file is
streamed in windows of ``batch_size * concurrency`` rows, so its size does not matter.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from rlfleet.common.config import RlfleetConfig, load_config
from rlfleet.common.entry import base_parser, setup_logging
from rlfleet.common.errors import InvalidArgument, RlfleetError
from rlfleet.reward.types import ScoreRequest, ScoreResult


@dataclass
class Summary:
    """Totals over the rows written so far."""

    rows: int = 0
    errors: int = 0
    score_sum: float = 0.0

    def add(self, result: ScoreResult) -> None:
        self.rows += 1
        if result.error:
            self.errors += 1
        else:
            self.score_sum += result.score

    @property
    def mean_score(self) -> float:
        scored = self.rows - self.errors
        return self.score_sum / scored if scored else float("nan")

    def describe(self) -> str:
        return (f"{self.rows} rows: mean score {self.mean_score:.4f} over "
                f"{self.rows - self.errors} scored, {self.errors} errors")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args, config = parse(argv)
    try:
        summary = asyncio.run(score_file(args, config))
    except (RlfleetError, TimeoutError, RuntimeError, OSError, ValueError) as exc:
        print(f"rlfleet score: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"{summary.describe()} -> {args.output}")
    return 0


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, RlfleetConfig]:
    parser = base_parser("score", "Score a verl-schema JSONL file through the reward service.")
    parser.add_argument("--input", required=True, help="JSONL rows with responses")
    parser.add_argument("--output", required=True, help="JSONL with `score` added")
    parser.add_argument("--address", help="reward gRPC address (default endpoints.reward)")
    parser.add_argument("--api-key", help="API key (default: api_key / RLFLEET_API_KEY)")
    parser.add_argument("--response-field", default="response", help="field holding the text")
    parser.add_argument("--scorer", help="score every row with this scorer, ignoring data_source")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per ScoreBatch call")
    parser.add_argument("--concurrency", type=int, default=4, help="ScoreBatch calls in flight")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.concurrency < 1:
        parser.error("--batch-size and --concurrency must be >= 1")
    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, OSError) as exc:
        parser.error(f"bad config: {exc}")
    setup_logging("WARNING", "score")
    return args, config


async def score_file(args: argparse.Namespace, config: RlfleetConfig) -> Summary:
    from tqdm import tqdm

    from rlfleet.reward.client import RewardClient

    summary = Summary()
    window = args.batch_size * args.concurrency
    address = args.address or config.endpoints.reward
    async with RewardClient(address, args.api_key or config.api_key) as client:
        with open(args.input) as src, open(args.output, "w") as dst:
            bar = tqdm(total=_count_lines(args.input), unit="row", disable=args.no_progress)
            for rows in _chunks(read_rows(src), window):
                results = await score_rows(client, rows, args)
                _write(dst, rows, results, summary)
                bar.update(len(rows))
            bar.close()
    return summary


async def score_rows(client: Any, rows: list[tuple[int, dict]], args: argparse.Namespace) -> list:
    """One result per row, in order; rows that cannot form a request get a local error."""
    results: list[ScoreResult | None] = [None] * len(rows)
    valid: list[tuple[int, ScoreRequest]] = []
    for position, (line_no, row) in enumerate(rows):
        try:
            valid.append((position, row_to_request(row, line_no, args.response_field, args.scorer)))
        except InvalidArgument as exc:
            results[position] = ScoreResult(id=str(line_no), error=f"InvalidArgument: {exc}")
    batches = [valid[i : i + args.batch_size] for i in range(0, len(valid), args.batch_size)]
    replies = await asyncio.gather(*(client.score_batch([r for _, r in b]) for b in batches))
    for batch, reply in zip(batches, replies, strict=True):
        for (position, _), result in zip(batch, reply, strict=True):
            results[position] = result
    return results


def row_to_request(
    row: dict, line_no: int, response_field: str, scorer: str | None = None
) -> ScoreRequest:
    """A verl-schema row as a ScoreRequest (id = its line number)."""
    if response_field not in row:
        raise InvalidArgument(f"line {line_no}: no {response_field!r} field (--response-field)")
    reward_model = row.get("reward_model") or {}
    truth = reward_model.get("ground_truth", row.get("ground_truth", ""))
    request = ScoreRequest(
        id=str(line_no),
        data_source=str(row.get("data_source") or ""),
        solution_str=row[response_field],
        ground_truth=truth,
        extra_info=row.get("extra_info") or {},
        scorer=scorer,
    )
    request.validate()
    return request


def read_rows(src: IO[str]) -> Iterator[tuple[int, dict]]:
    """(line number, row) for every non-blank line; a line that is not a JSON object stops us."""
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


def _write(dst: IO[str], rows: list, results: list, summary: Summary) -> None:
    for (_, row), result in zip(rows, results, strict=True):
        out = dict(row, score=result.score)
        if result.metrics:
            out["score_metrics"] = result.metrics
        if result.error:
            out["score_error"] = result.error
        dst.write(json.dumps(out) + "\n")
        summary.add(result)


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


if __name__ == "__main__":
    raise SystemExit(main())
