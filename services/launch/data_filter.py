"""``rlfleet data filter``: keep the prompts a model solves sometimes (the filter itself:
``rlfleet.tasks.difficulty_filter``).

The samples come through the fleet, the path training uses: a running one (``--router``, or
``--run-dir`` of an ``rlfleet up``), or one started here for the command's length
(``rlfleet.launch.serving``) from ``--config``'s model and rollout settings. Prompts are
tokenized as the trainer tokenizes them (``data.apply_chat_template``), ``--k`` answers each,
many prompts per ``GenerateBatch`` call.

Scoring goes through the reward service, as held-out evaluation does
(``rlfleet.trainer.evaluate.score_texts``): it is the one owner of scoring, so a pass here is
a pass in training, user functions, sandbox and judges included, and the data sources it takes
(``ListScorers``) are checked before any sampling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from rlfleet.common import tls
from rlfleet.common.endpoints import read_endpoints
from rlfleet.common.entry import setup_logging
from rlfleet.common.errors import RlfleetError
from rlfleet.tasks import difficulty_filter as df

SUBCOMMANDS = {"filter": "keep prompts whose sampled pass rate lies in a band"}


def parse(argv: list[str] | None) -> argparse.Namespace:
    """``rlfleet data filter ...`` (the one subcommand so far; argparse's subparsers cannot
    take overrides among the options, so the word is read here)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        lines = [f"  {name}  {text}" for name, text in SUBCOMMANDS.items()]
        print("usage: rlfleet data {filter} [--help] ...\n\nsubcommands:\n" + "\n".join(lines))
        raise SystemExit(0 if argv[:1] in ([], ["-h"], ["--help"]) else 2)
    p = argparse.ArgumentParser(
        prog="rlfleet data filter",
        description="Sample --k answers per prompt through the fleet (a running one, or one "
        "started for the command) and keep the prompts whose pass rate lies in --band.",
    )
    p.add_argument("--input", required=True, help="verl-schema .parquet (or JSONL) prompts")
    p.add_argument("--output", required=True, help=".parquet with the kept rows")
    p.add_argument("--config", help="YAML config: model, rollout and data settings")
    p.add_argument("--k", type=int, default=8, help="answers sampled per prompt (default 8)")
    p.add_argument(
        "--band",
        type=band,
        default=df.Band(),
        help="LOW,HIGH: pass rates kept, both ends included (default 0.2,0.8)",
    )
    p.add_argument("--temperature", type=float, help="default rollout.temperature")
    p.add_argument("--max-tokens", type=int, help="default rollout.max_tokens")
    p.add_argument(
        "--correct-at",
        type=float,
        default=1.0,
        help="a score at least this is a pass (default 1.0: full credit)",
    )
    p.add_argument("--limit", type=int, help="only the first N rows")
    p.add_argument("--held-out", help="drop rows whose problem occurs in this file")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per GenerateBatch call")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per GenerateBatch call")
    fleet = p.add_mutually_exclusive_group()
    fleet.add_argument("--router", help="a running router's gRPC address (reward: --reward)")
    fleet.add_argument("--run-dir", help="a running fleet's DIR/endpoints.json (rlfleet up)")
    p.add_argument("--reward", help="reward gRPC address with --router (default endpoints.reward)")
    p.add_argument("--replicas", type=int, default=1, help="replicas of a fleet started here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=...")
    args = p.parse_intermixed_args(argv[1:])
    if min(args.k, args.batch_size, args.replicas, args.limit or 1) < 1:
        p.error("--k, --batch-size, --replicas and --limit must be >= 1")
    if not Path(args.input).expanduser().is_file():
        p.error(f"--input: no such file: {args.input}")
    sampling = {"temperature": args.temperature, "max_tokens": args.max_tokens}
    args.overrides += [
        f"rollout.{key}={value}" for key, value in sampling.items() if value is not None
    ]
    return args


def band(text: str) -> df.Band:
    try:
        return df.Band.parse(text)
    except ValueError as exc:  # argparse shows this text, not "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup_logging("WARNING", "data")
    try:
        return run(args)
    except (ValueError, RlfleetError, TimeoutError, OSError, RuntimeError) as exc:
        print(f"rlfleet data filter: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rlfleet data filter: interrupted; nothing written", file=sys.stderr)
        return 130


def run(args: argparse.Namespace) -> int:
    from rlfleet.common.config import load_config

    config = load_config(args.config, args.overrides)
    tls.use(config.tls)  # the fleet's TLS (and its client certificate) for router and reward
    table = df.read_table(args.input)
    rows = table.to_pylist()
    chosen = list(range(len(rows)))
    if args.held_out:
        chosen = df.without_problems(rows, df.read_table(args.held_out).to_pylist())
        print(f"dropped {len(rows) - len(chosen)} rows whose problem is in {args.held_out}")
    chosen = chosen[: args.limit]
    if not chosen:
        raise ValueError(f"no rows to filter in {args.input}")
    with fleet_addresses(args, config) as (router, reward):
        rates = asyncio.run(measure(args, config, [rows[i] for i in chosen], router, reward))
    counts = df.histogram(rates, args.k)
    print(f"pass-rate histogram (k={args.k}): {df.format_histogram(counts)}")
    kept = df.keep_in_band([rows[i] for i in chosen], rates, args.band, args.k)
    df.write_kept(
        table, [chosen[i] for i in kept], [rates[i] for i in kept], args.k, Path(args.output)
    )
    print(
        f"{len(rows)} rows in, {len(chosen)} sampled, {len(kept)} kept with pass rate in "
        f"{args.band} -> {args.output}"
    )
    return 0


@contextlib.contextmanager
def fleet_addresses(args: argparse.Namespace, config) -> Iterator[tuple[str, str]]:
    """(router, reward) gRPC addresses: the running fleet named, or one started here."""
    if args.router:
        yield args.router, args.reward or config.endpoints.reward
    elif args.run_dir:
        found = read_endpoints(args.run_dir)
        if "router" not in found or "reward" not in found:
            raise ValueError(f"{args.run_dir}/endpoints.json names no router and reward")
        yield found["router"]["grpc"], found["reward"]["grpc"]
    else:
        from rlfleet.launch.serving import serving_fleet

        wait_s = config.trainer.replica_wait_s
        with serving_fleet(args.config, args.overrides, args.replicas, wait_s) as fleet:
            yield fleet.router, fleet.reward


async def measure(args, config, rows: list[dict], router: str, reward_at: str) -> list[float]:
    """Every row's pass rate from ``args.k`` answers sampled through ``router``."""
    from tqdm import tqdm

    from rlfleet.model.model_io import load_tokenizer
    from rlfleet.reward.client import RewardClient
    from rlfleet.rollout.client import RolloutClient

    tokenizer = load_tokenizer(config.model.path)
    records = prompt_records(rows, tokenizer, config)
    key, mb = config.api_key, config.max_message_mb
    async with RolloutClient(router, key, mb) as rollout, RewardClient(reward_at, key) as reward:
        scorers = await reward.list_scorers()
        known = {source for s in scorers for source in s.data_sources}
        df.check_scored(rows, known - {"*"}, takes_any="*" in known)
        judge = FleetJudge(rollout, reward, tokenizer, sampling_of(args, config), args.timeout_s)
        with tqdm(total=len(rows), unit="prompt", disable=args.no_progress) as bar:
            return await df.measure(records, judge, args.batch_size, args.correct_at, bar)


def prompt_records(rows: list[dict], tokenizer, config) -> list:
    """Each row as the trainer reads it, tokenized as the trainer does (too long: an error)."""
    from rlfleet.model.model_io import encode_prompt
    from rlfleet.trainer.data import to_record

    records, limit = [], config.data.max_prompt_length
    for index, row in enumerate(rows):
        record = to_record(row, f"row {index + 1}")
        record.token_ids = encode_prompt(tokenizer, record.prompt, config.data.apply_chat_template)
        if len(record.token_ids) > limit:
            raise ValueError(
                f"row {index + 1}: prompt has {len(record.token_ids)} tokens > "
                f"data.max_prompt_length={limit}"
            )
        records.append(record)
    return records


def sampling_of(args, config):
    from rlfleet.rollout.types import SamplingParams

    r = config.rollout
    return SamplingParams(
        n=args.k, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens
    )


class FleetJudge:
    """``df.Judge`` through the fleet: one ``GenerateBatch`` and one ``ScoreBatch`` a batch."""

    def __init__(self, rollout, reward, tokenizer, sampling, timeout_s: float) -> None:
        self.rollout, self.reward, self.tokenizer = rollout, reward, tokenizer
        self.sampling, self.timeout_s = sampling, timeout_s
        self.tag = f"filter-{uuid.uuid4().hex[:8]}"
        self.sent = 0

    async def __call__(self, records: Sequence) -> list[list[float]]:
        from rlfleet.rollout.types import GenerateRequest
        from rlfleet.trainer.evaluate import score_of, score_texts

        ids = [f"{self.tag}-{self.sent + i}" for i in range(len(records))]
        self.sent += len(records)
        requests = [
            GenerateRequest(
                request_id=i,
                sampling=self.sampling,
                session_id=i,
                prompt_token_ids=r.token_ids,
                timeout_s=self.timeout_s,
            )
            for i, r in zip(ids, records, strict=True)
        ]
        results = await self.rollout.generate_batch(requests)
        groups = [[c.token_ids for c in result.completions] for result in results]
        texts = [self.tokenizer.decode(t, skip_special_tokens=True) for g in groups for t in g]
        flat = [record for record, group in zip(records, groups, strict=True) for _ in group]
        scores = iter([score_of(r) for r in await score_texts(self.reward, flat, texts)])
        return [[next(scores) for _ in group] for group in groups]


if __name__ == "__main__":
    raise SystemExit(main())
