"""``rlfleet score``: score a JSONL or Parquet file of responses through the reward service.

Rows use verl's schema (``score_io``): one response per row (``response``) or several
(``responses``). Each output row is the input row with ``score`` (``scores`` for several) and,
when there are any, ``score_metrics`` / ``score_error``, in input order; the output is Parquet
when its name ends in ``.parquet``. The file is streamed in windows of
``batch_size * concurrency`` rows, so its size does not matter. At the end: the mean score per
``data_source``; and when any row failed, a count of them on stderr and exit code 1 (bad
arguments, an unreachable service or an unreadable file: 2).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig, load_config
from rlfleet.common.entry import base_parser, setup_logging
from rlfleet.common.errors import InvalidArgument, RlfleetError
from rlfleet.reward.score_io import RowWriter, ScoredRow, count_rows, read_rows, row_requests
from rlfleet.reward.types import ScoreRequest, ScoreResult


@dataclass
class SourceTotals:
    rows: int = 0
    failed: int = 0
    scored: int = 0
    score_sum: float = 0.0

    def add(self, scored: ScoredRow) -> None:
        self.rows += 1
        self.failed += scored.failed
        ok = [r.score for r in scored.results if not r.error]
        self.scored += len(ok)
        self.score_sum += sum(ok)

    @property
    def mean(self) -> float:
        return self.score_sum / self.scored if self.scored else float("nan")


@dataclass
class Summary:
    """Totals over the rows written so far, overall and per ``data_source``."""

    total: SourceTotals = field(default_factory=SourceTotals)
    by_source: dict[str, SourceTotals] = field(default_factory=dict)

    def add(self, scored: ScoredRow) -> None:
        self.total.add(scored)
        source = str(scored.row.get("data_source") or "")
        self.by_source.setdefault(source, SourceTotals()).add(scored)

    def describe(self) -> str:
        t = self.total
        return f"{t.rows} rows: mean score {t.mean:.4f} over {t.scored} scored, {t.failed} errors"

    def table(self) -> str:
        width = max([len("data_source"), *map(len, self.by_source)])
        lines = [f"{'data_source':<{width}}  {'rows':>7}  {'failed':>7}  {'mean_score':>10}"]
        for source, t in sorted(self.by_source.items()):
            lines.append(f"{source or '-':<{width}}  {t.rows:>7}  {t.failed:>7}  {t.mean:>10.4f}")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, config = parse(argv)
    try:
        summary = asyncio.run(score_file(args, config))
    except (RlfleetError, TimeoutError, RuntimeError, OSError, ValueError) as exc:
        print(f"rlfleet score: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(summary.table())
    print(f"{summary.describe()} -> {args.output}")
    if summary.total.failed:
        print(
            f"rlfleet score: {summary.total.failed} rows failed (see score_error in {args.output})",
            file=sys.stderr,
        )
        return 1
    return 0


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, RlfleetConfig]:
    parser = base_parser(
        "score", "Score a verl-schema JSONL/Parquet file through the reward service."
    )
    parser.add_argument("--input", required=True, help="JSONL or .parquet rows with responses")
    parser.add_argument("--output", required=True, help="JSONL (or .parquet) with scores added")
    parser.add_argument("--address", help="reward gRPC address (default endpoints.reward)")
    parser.add_argument("--api-key", help="API key (default: api_key / RLFLEET_API_KEY)")
    parser.add_argument(
        "--response-field",
        help="field holding the text, or a list of texts (default: responses "
        "if the row has it, else response)",
    )
    parser.add_argument("--scorer", help="score every row with this scorer, ignoring data_source")
    parser.add_argument("--batch-size", type=int, default=256, help="items per ScoreBatch call")
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
    tls.use(config.tls)  # the fleet's TLS (and its client certificate) for the reward service
    return args, config


async def score_file(args: argparse.Namespace, config: RlfleetConfig) -> Summary:
    from tqdm import tqdm

    from rlfleet.reward.client import RewardClient

    summary, writer = Summary(), RowWriter(args.output)
    window = args.batch_size * args.concurrency
    address = args.address or config.endpoints.reward
    bar = tqdm(total=count_rows(args.input), unit="row", disable=args.no_progress)
    try:
        async with RewardClient(address, args.api_key or config.api_key) as client:
            for rows in _chunks(read_rows(args.input), window):
                for scored in await score_rows(client, rows, args):
                    writer.write(scored)
                    summary.add(scored)
                bar.update(len(rows))
    finally:
        bar.close()
        writer.close()
    return summary


async def score_rows(
    client: Any, rows: list[tuple[int, dict]], args: argparse.Namespace
) -> list[ScoredRow]:
    """Every row with its results, in order; a row that cannot form requests gets an error."""
    out, items = [], []
    for number, row in rows:
        try:
            requests, many = row_requests(row, number, args.response_field, args.scorer)
            out.append(ScoredRow(number, row, [], many))
            items += [(len(out) - 1, r) for r in requests]
        except InvalidArgument as exc:
            failure = ScoreResult(id=str(number), error=f"InvalidArgument: {exc}")
            out.append(ScoredRow(number, row, [failure], many=False))
    batches = [items[i : i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    replies = await asyncio.gather(*(client.score_batch(_requests(b)) for b in batches))
    for batch, reply in zip(batches, replies, strict=True):
        for (position, _), result in zip(batch, reply, strict=True):
            out[position].results.append(result)
    return out


def row_to_request(
    row: dict, number: int, response_field: str | None = "response", scorer: str | None = None
) -> ScoreRequest:
    """A single-response verl row as one ScoreRequest (id = its row number)."""
    return row_requests(row, number, response_field, scorer)[0][0]


def _requests(batch: list[tuple[int, ScoreRequest]]) -> list[ScoreRequest]:
    return [request for _, request in batch]


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


if __name__ == "__main__":
    raise SystemExit(main())
