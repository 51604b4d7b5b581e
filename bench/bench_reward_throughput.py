"""Reward scores per second: in-process against gRPC batch against HTTP batch, 1 against 2 workers.

Why: the reward service exists to be called from outside (gRPC, HTTP), and to scale out by
adding worker processes. What each front door costs over scoring in the caller's own process,
and what a second worker buys, are the numbers to know before sizing a fleet.

Variants (all in one run, rounds interleaved in ABBA order):

- ``inproc``: ``BatchScorer`` (the workers' own scoring code) in this process; no Redis, no RPC.
- ``grpc-1w`` / ``http-1w``: ``ScoreBatch`` / ``POST /v1/score/batch`` to a real ``python -m
  rlfleet.reward.main`` with one in-process worker (``reward.workers=1``).
- ``grpc-2w`` / ``http-2w``: the same against a second server (its own cluster on the same
  embedded Valkey) plus one ``--worker-only`` process: two worker processes.

Load: ``CALLERS`` callers at once, each sending batches one after another. With one caller
local-first (``reward.local_first``) scores every batch in the front door's process and a
second worker never gets work; with two, one batch is scored locally and the other goes
through the stream, where a second worker process can take it.

Scorers: ``math`` (boxed answers, ``math-verify`` for the non-identical ones, run in a
thread) and ``code`` (two assertion tests per item, each a sandboxed Python process).
Throughput is items scored / wall time of the round (all callers' batches).

Usage: ``python bench/bench_reward_throughput.py [--quick]`` (or ``run_all.py --only
reward_throughput``); writes ``bench/results/reward_throughput.json`` and ``.md``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO, BenchResult, Options, Stats, abba, progress, ratio, stop_child

NAME = "reward_throughput"
TITLE = "Reward scores/s: in-process vs gRPC vs HTTP batch, 1 vs 2 workers"
VARIANTS = ["inproc", "grpc-1w", "http-1w", "grpc-2w", "http-2w"]
CALLERS = 2
MATH_ITEMS, CODE_ITEMS = 64, 6
WARMUP_ITEMS = 2
START_TIMEOUT_S = 180.0
Call = Callable[[list[Any]], Awaitable[list[Any]]]

# (boxed answer, ground truth): identical, equivalent only symbolically, wrong, unboxed
MATH_CASES = [
    ("{n}", "{n}"),
    ("\\frac{{{n}}}{{2}}", "{h}"),
    ("{n}.0", "{n}"),
    ("\\sqrt{{{sq}}}", "{n}"),
    ("{m}", "{n}"),
    (None, "{n}"),
]
CODE_RIGHT = "def add(a, b):\n    return a + b\n"
CODE_WRONG = "def add(a, b):\n    return a - b\n"


@dataclass
class Server:
    """A reward front door we started, with its gRPC and HTTP addresses."""

    grpc: str
    http: str
    procs: list[subprocess.Popen]


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    rounds = {"math": options.pick(6, 2), "code": options.pick(4, 2)}
    batches = {"math": options.pick(4, 2), "code": options.pick(2, 1)}
    with ExitStack() as stack:
        redis = stack.enter_context(EmbeddedRedis(options.work_dir / "reward-redis"))
        one = stack.enter_context(_server(redis.url, "rw1", 0, options.work_dir))
        two = stack.enter_context(_server(redis.url, "rw2", 1, options.work_dir))
        progress("reward_throughput: servers up (1 worker; 1 + 1 worker-only)")
        samples = asyncio.run(_measure(one, two, redis.url, rounds, batches))
    return _result(samples, rounds, batches)


# ---- processes ---------------------------------------------------------------------------


@contextmanager
def _server(redis_url: str, cluster: str, extra_workers: int, work_dir: Path) -> Iterator[Server]:
    """A front door with one worker, plus ``extra_workers`` worker-only processes."""
    from rlfleet.common.redis_server import free_port

    grpc_port, http_port = free_port(), free_port()
    common_args = [f"redis_url={redis_url}", f"cluster={cluster}", "reward.workers=1"]
    front = [*common_args, f"reward.http_port={http_port}", "--port", str(grpc_port)]
    procs = [_spawn(front, work_dir / f"{cluster}-front.log", work_dir)]
    for index in range(extra_workers):
        log = work_dir / f"{cluster}-worker{index}.log"
        procs.append(_spawn([*common_args, "--worker-only"], log, work_dir))
    try:
        yield Server(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", procs)
    finally:
        for proc in procs:
            stop_child(proc)


def _spawn(args: list[str], log_path: Path, work_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    env["RLFLEET_RUN_DIR"] = str(work_dir)
    argv = [sys.executable, "-m", "rlfleet.reward.main", *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


# ---- workload ----------------------------------------------------------------------------


def math_items(batch: int) -> list[dict[str, Any]]:
    """``MATH_ITEMS`` math requests: about a third need math-verify, a sixth are wrong."""
    items = []
    for i in range(MATH_ITEMS):
        n = 2 * (i + 3 * batch) + 2
        said, truth = MATH_CASES[i % len(MATH_CASES)]
        values = {"n": n, "h": n // 2, "sq": n * n, "m": n + 1}
        answer = f"\\boxed{{{said.format(**values)}}}" if said else f"{n}"
        items.append(
            {
                "id": f"m{i}",
                "data_source": "lighteval/MATH",
                "solution_str": f"The answer is {answer}.",
                "ground_truth": truth.format(**values),
            }
        )
    return items


def code_items(batch: int) -> list[dict[str, Any]]:
    """``CODE_ITEMS`` code requests, two assertion tests each; every fourth solution is wrong."""
    items = []
    for i in range(CODE_ITEMS):
        solution = CODE_WRONG if i % 4 == 3 else CODE_RIGHT
        tests = [f"assert add({i}, {batch}) == {i + batch}", f"assert add(-{i}, 1) == {1 - i}"]
        items.append(
            {
                "id": f"c{i}",
                "data_source": "code",
                "scorer": "code",
                "solution_str": f"```python\n{solution}```",
                "ground_truth": {"tests": tests},
            }
        )
    return items


WORKLOADS = {"math": math_items, "code": code_items}


# ---- measuring ---------------------------------------------------------------------------


async def _measure(
    one: Server, two: Server, redis_url: str, rounds: dict[str, int], batches: dict[str, int]
):
    """(scorer, variant) -> [(seconds of the round, items, score sum, errors)]."""
    stack: list[Callable[[], Awaitable[None]]] = []
    try:
        calls = await _callers(one, two, stack)
        await _wait_workers(redis_url, "rw2", 2)
        samples: dict[tuple[str, str], list[tuple[float, int, float, int]]] = {}
        for scorer, make in WORKLOADS.items():
            for variant in VARIANTS:  # warm-up: imports, connections, first sandbox run
                await calls[variant](make(0)[:WARMUP_ITEMS])
            for _, variant in abba(VARIANTS, rounds[scorer]):
                sample = await _round(calls[variant], make, batches[scorer])
                samples.setdefault((scorer, variant), []).append(sample)
            progress(f"reward_throughput: {scorer} done")
        return samples
    finally:
        for close in reversed(stack):
            await close()


async def _round(call: Call, make: Callable[[int], list], batches: int):
    """``CALLERS`` callers, each sending ``batches`` batches one after another."""

    async def caller(who: int) -> list[Any]:
        results = []
        for index in range(batches):
            results += await call(make(who * 100 + index))
        return results

    start = time.perf_counter()
    per_caller = await asyncio.gather(*(caller(who) for who in range(CALLERS)))
    elapsed = time.perf_counter() - start
    results = [r for rs in per_caller for r in rs]
    errors = sum(bool(r["error"]) for r in results)
    return elapsed, len(results), sum(r["score"] for r in results), errors


async def _callers(one: Server, two: Server, stack: list) -> dict[str, Call]:
    return {
        "inproc": _inproc(stack),
        "grpc-1w": await _grpc(one, stack),
        "http-1w": await _http(one, stack),
        "grpc-2w": await _grpc(two, stack),
        "http-2w": await _http(two, stack),
    }


def _inproc(stack: list) -> Call:
    from rlfleet.common.config import RewardConfig
    from rlfleet.reward.batch_scorer import BatchScorer
    from rlfleet.reward.scorers import build_registry
    from rlfleet.reward.types import ScoreRequest

    engine = BatchScorer(build_registry(RewardConfig()))

    async def close() -> None:
        engine.close()

    stack.append(close)

    async def call(items: list[dict]) -> list[dict]:
        results = await engine.score_all([ScoreRequest.from_dict(item) for item in items])
        return [{"score": r.score, "error": r.error} for r in results]

    return call


async def _grpc(server: Server, stack: list) -> Call:
    from rlfleet.reward.client import RewardClient

    client = RewardClient(server.grpc, timeout_s=300)
    stack.append(client.close)
    await _wait_started(client, server)

    async def call(items: list[dict]) -> list[dict]:
        return [{"score": r.score, "error": r.error} for r in await client.score_batch(items)]

    return call


async def _http(server: Server, stack: list) -> Call:
    import httpx

    client = httpx.AsyncClient(base_url=server.http, timeout=300)
    stack.append(client.aclose)
    path = await _batch_path(client)

    async def call(items: list[dict]) -> list[dict]:
        reply = await client.post(path, json={"requests": items})
        reply.raise_for_status()
        return reply.json()["results"]

    return call


async def _batch_path(client: Any) -> str:
    """``/v1/score/batch`` (issue 8's route), or ``/score_batch`` on a tree without it."""
    probe = {
        "requests": [{"id": "p", "data_source": "arith", "solution_str": "1", "ground_truth": "1"}]
    }
    for path in ("/v1/score/batch", "/score_batch"):
        if (await client.post(path, json=probe)).status_code != 404:
            return path
    raise RuntimeError("the reward HTTP server has no batch route")


async def _wait_started(client: Any, server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in server.procs):
            break
        try:
            await client.wait_ready(5)
            return
        except Exception:  # noqa: BLE001 - not listening yet
            await asyncio.sleep(0.5)
    raise RuntimeError(f"reward server {server.grpc} did not start; see bench/results/work")


async def _wait_workers(redis_url: str, cluster: str, count: int) -> None:
    """Until ``count`` consumers read the cluster's reward stream (the worker-only is up)."""
    import redis.asyncio as aioredis
    from redis.exceptions import ResponseError

    from rlfleet.common.keys import REWARD_GROUP, Keys

    redis = aioredis.Redis.from_url(redis_url)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            try:
                rows = await redis.xinfo_consumers(Keys(cluster).reward_stream, REWARD_GROUP)
                if len(rows) >= count:
                    return
            except ResponseError:
                pass  # no group yet
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{count} reward workers of {cluster} did not show up")
    finally:
        await redis.aclose()


# ---- result ------------------------------------------------------------------------------


def _result(samples, rounds: dict[str, int], batches: dict[str, int]) -> BenchResult:
    rows = [_row(scorer, variant, runs) for (scorer, variant), runs in samples.items()]
    rate = {(r["scorer"], r["variant"]): r["items_per_s"] for r in rows}
    ratios = {}
    for scorer in WORKLOADS:
        pairs = [
            ("grpc-1w", "inproc"),
            ("http-1w", "inproc"),
            ("http-1w", "grpc-1w"),
            ("grpc-2w", "grpc-1w"),
            ("http-2w", "http-1w"),
        ]
        for top, bottom in pairs:
            ratios[f"{scorer} {top}/{bottom} items/s"] = ratio(
                rate[(scorer, top)], rate[(scorer, bottom)]
            )
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios,
        columns=[
            "scorer",
            "variant",
            "rounds",
            "items_per_s",
            "round_p50_s",
            "batch_items",
            "score_mean",
            "errors",
        ],
        params={
            "callers": CALLERS,
            "batches_per_caller": batches,
            "rounds": rounds,
            "math_items": MATH_ITEMS,
            "code_items": CODE_ITEMS,
            "code_tests_per_item": 2,
        },
        notes=[
            "items_per_s: all items of a scorer's rounds / their summed wall time; each round "
            f"is {CALLERS} callers at once, each sending its batches one after another.",
            "1w: a front door with reward.workers=1 (local-first on); 2w: the same plus one "
            "`--worker-only` process (reward.workers=1) on the same stream. inproc: "
            "BatchScorer in the benchmark's own process.",
            "score_mean must agree across variants (same items): a check that every path "
            "scored, not just answered.",
        ],
    )


def _row(scorer: str, variant: str, runs: list[tuple[float, int, float, int]]) -> dict:
    seconds, items = sum(r[0] for r in runs), sum(r[1] for r in runs)
    return {
        "scorer": scorer,
        "variant": variant,
        "rounds": len(runs),
        "items_per_s": items / seconds,
        "round_p50_s": Stats.of([r[0] for r in runs]).p50,
        "batch_items": MATH_ITEMS if scorer == "math" else CODE_ITEMS,
        "score_mean": sum(r[2] for r in runs) / items,
        "errors": sum(r[3] for r in runs),
    }


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
