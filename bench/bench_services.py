"""Reward and refcritic through their real gRPC servers: local first vs the Redis queue path.

Why: a 256-item arith ScoreBatch is ~1 ms of regex work, and a 256-sequence
ComputeRefLogProbs one forward pass; what the queue path adds on top (Redis round trips, JSON,
chunking) is what ``reward.local_first`` / ``refcritic.local_first`` remove when the front
door's own worker is idle. Each variant is a real server process (``python -m
rlfleet.<role>.main``) with one in-process worker, on an embedded Valkey of its own, so that
``INFO commandstats`` counts only that variant's commands (INFO itself excluded). Calls are
interleaved across variants in ABBA order.

Variants: ``local`` (this tree, default config), ``queue`` (this tree, ``local_first=false``:
one job per batch) and, with ``--before DIR``, ``before``: another rlfleet tree (a folder
holding an ``rlfleet`` package, e.g. ``git archive <rev> services`` unpacked with a
``rlfleet -> services`` link) run the same way, for a before/after comparison.

Usage: ``python bench/bench_services.py [--quick] [--before DIR]``; writes
``bench/results/services.json`` and ``services.md``.
"""

from __future__ import annotations

import argparse
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

from common import MODEL_DIR, REPO, RESULTS_DIR, BenchResult, Options, Stats, abba, progress, ratio

NAME = "services"
TITLE = "Reward ScoreBatch and refcritic ComputeRefLogProbs: local first vs queue"
ITEMS = 256
START_TIMEOUT_S = 180.0


@dataclass
class Server:
    """One variant's server process, its Redis and its address."""

    role: str
    variant: str
    address: str
    redis_url: str
    process: subprocess.Popen


def run(options: Options, before: Path | None = None) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    variants = ["local", "queue", *(["before"] if before else [])]
    rounds = {"reward": options.pick(40, 8), "refcritic": options.pick(8, 3)}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for role in ("reward", "refcritic"):
        with ExitStack() as stack:
            servers = {}
            for variant in variants:
                redis = stack.enter_context(EmbeddedRedis(options.work_dir / f"{role}-{variant}"))
                servers[variant] = stack.enter_context(
                    _server(role, variant, redis.url, options.work_dir, before)
                )
            progress(f"services: {role} servers up ({', '.join(variants)})")
            samples.update(asyncio.run(_measure(role, servers, rounds[role])))
    return _result(samples, variants, rounds, before)


@contextmanager
def _server(
    role: str, variant: str, redis_url: str, work_dir: Path, before: Path | None
) -> Iterator[Server]:
    from rlfleet.common.redis_server import free_port

    port, env = free_port(), dict(os.environ)
    if variant == "before" and before is not None:
        env["PYTHONPATH"] = str(before)
    switch = [f"{role}.local_first=false"] if variant == "queue" else []
    extra = (
        [f"model.path={MODEL_DIR}", "refcritic.critic_enabled=false"] if role == "refcritic" else []
    )
    argv = [
        sys.executable,
        "-m",
        f"rlfleet.{role}.main",
        f"redis_url={redis_url}",
        f"cluster=bench{variant}",
        *extra,
        *switch,
        "--port",
        str(port),
    ]
    log = (work_dir / f"{role}-{variant}.log").open("wb")
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Server(role, variant, f"127.0.0.1:{port}", redis_url, process)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


async def _measure(role: str, servers: dict[str, Server], rounds: int):
    """(role, variant) -> [(seconds, redis commands)] per call."""
    calls = {variant: await _caller(role, server) for variant, server in servers.items()}
    clients = {variant: await _redis(server.redis_url) for variant, server in servers.items()}
    try:
        for variant in servers:  # warm-up: connections, first-call imports, stream creation
            for _ in range(2):
                await calls[variant][0]()
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _, variant in abba(list(servers), rounds):
            samples.setdefault((role, variant), []).append(
                await _one(calls[variant][0], clients[variant])
            )
        return samples
    finally:
        for _, close in calls.values():
            await close()
        for client in clients.values():
            await client.aclose()


async def _one(call: Callable[[], Awaitable[Any]], redis: Any) -> tuple[float, float]:
    before = await _commands(redis)
    start = time.perf_counter()
    await call()
    elapsed = time.perf_counter() - start
    return elapsed, await _commands(redis) - before


async def _redis(url: str) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url)


async def _commands(redis: Any) -> int:
    """Commands the server has run so far, INFO itself excluded."""
    stats = await redis.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


async def _caller(role: str, server: Server):
    """(call, close): one ScoreBatch of 256 arith items, or one 256-sequence RefLogProbs."""
    if role == "reward":
        from rlfleet.reward.client import RewardClient
        from rlfleet.reward.types import ScoreRequest

        client = RewardClient(server.address, timeout_s=120)
        items = [ScoreRequest(str(i), "arith", str(i + i % 2), str(i)) for i in range(ITEMS)]
        call = lambda: client.score_batch(items)  # noqa: E731
    else:
        from rlfleet.refcritic.client import RefCriticClient

        client = RefCriticClient(server.address, timeout_s=300)
        prompts = [[4 + (i + j) % 11 for j in range(16)] for i in range(ITEMS)]
        responses = [[5 + (i * j) % 9 for j in range(1 + i % 16)] for i in range(ITEMS)]
        call = lambda: client.ref_logprobs(prompts, responses)  # noqa: E731
    await _wait_started(client, server)
    return call, client.close


async def _wait_started(client: Any, server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while server.process.poll() is None and time.monotonic() < deadline:
        try:
            await client.wait_ready(5)
            return
        except Exception:  # noqa: BLE001 - not listening yet
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{server.role} ({server.variant}) did not start; see its log")


def _result(samples, variants: list[str], rounds: dict[str, int], before: Path | None):
    rows, ratios = [], {}
    for (role, variant), pairs in samples.items():
        stats = Stats.of([s for s, _ in pairs])
        commands = sum(c for _, c in pairs) / len(pairs)
        rows.append(
            {
                "role": role,
                "variant": variant,
                "n": stats.n,
                "p50_ms": stats.p50 * 1e3,
                "mean_ms": stats.mean * 1e3,
                "redis_cmds_per_call": commands,
            }
        )
    p50 = {(r["role"], r["variant"]): r["p50_ms"] for r in rows}
    for role in ("reward", "refcritic"):
        for other in variants[1:]:
            ratios[f"{role} {other}/local p50"] = ratio(p50[(role, other)], p50[(role, "local")])
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios,
        columns=["role", "variant", "n", "p50_ms", "mean_ms", "redis_cmds_per_call"],
        params={
            "items": ITEMS,
            "rounds": rounds,
            "before": str(before) if before else None,
            "refcritic": "tiny-qwen2-arith, prompts 16 tokens, responses 1-16 tokens",
        },
        notes=[
            "One server process per variant, one in-process worker (reward.workers=1, "
            "refcritic.workers=1), each on its own embedded Valkey.",
            "redis_cmds_per_call: INFO commandstats delta over the call, including idle "
            "workers' polling (a blocked XREADGROUP every 0.5 s) during it.",
        ],
    )


def main(argv: list[str] | None = None) -> int:
    import common

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--before", type=Path, help="another rlfleet tree to compare against")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    options = Options(quick=args.quick)
    options.work_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    result = run(options, args.before)
    result.seconds = time.monotonic() - start
    path = common.write_result(result, common.machine_info(), args.out)
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
