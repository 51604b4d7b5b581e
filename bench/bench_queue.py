"""The Redis work queue's round trip against raw Redis commands, on a server we start ourselves.

Why: every rollout, reward and refcritic request goes through ``WorkQueue`` (submit → read →
complete → wait_result). Its cost over the bare Redis commands it is built on (a Lua submit,
the delivery-count and dead-letter bookkeeping, the answer transaction, the result read) is what
we pay per request on top of the network. The floor is a PING; the raw stream cycle is
XADD → XREADGROUP → XACK. All three run interleaved in one asyncio loop on one client, against
an embedded Valkey on a free loopback port (never the machine's own Redis on 6379).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from common import BenchResult, Options, Stats, abba, progress, ratio

NAME = "queue"
TITLE = "Redis work queue round trip vs raw Redis"
VARIANTS = ("ping", "raw_stream", "workqueue", "workqueue_waiting")
PAYLOAD = b'{"prompt_token_ids": [1, 5, 9, 12, 4, 11], "sampling": {"n": 8}}' * 3

Op = Callable[[int], Awaitable[Any]]


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    rounds = options.pick(full=3000, quick=300)
    options.work_dir.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis(options.work_dir / "queue-redis") as server:
        progress(f"queue: embedded Redis at {server.url}, {rounds} rounds per variant")
        samples = asyncio.run(_measure(server.url, rounds))
    return _result(samples, rounds)


async def _measure(url: str, rounds: int) -> dict[str, list[float]]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        ops = await _make_ops(client)
        for variant in VARIANTS:  # warm-up: connections, Lua script cache, stream creation
            for i in range(50):
                await ops[variant](-1 - i)
        return await _interleaved(ops, rounds)
    finally:
        await client.aclose()


async def _interleaved(ops: dict[str, Op], rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for index, variant in abba(VARIANTS, rounds):
        start = time.perf_counter()
        await ops[variant](index)
        samples[variant].append(time.perf_counter() - start)
        if index and index % 1000 == 0 and variant == VARIANTS[0]:
            progress(f"queue: round {index}/{rounds}")
    return samples


async def _make_ops(client: Any) -> dict[str, Op]:
    from rlfleet.common.keys import Keys
    from rlfleet.common.queue.workqueue import WorkQueue

    keys = Keys("bench")
    queue = WorkQueue(client, keys, keys.reward_stream, "workers", result_ttl_s=600)
    await queue.ensure_group()
    raw_stream = keys.rollout_stream("raw")
    await client.xgroup_create(raw_stream, "workers", id="0", mkstream=True)

    async def ping(_: int) -> None:
        await client.ping()

    async def raw(_: int) -> None:
        entry_id = await client.xadd(raw_stream, {"id": "x", "payload": PAYLOAD})
        await client.xreadgroup("workers", "w", {raw_stream: ">"}, count=1)
        await client.xack(raw_stream, "workers", entry_id)

    return {
        "ping": ping,
        "raw_stream": raw,
        "workqueue": _round_trip(queue),
        "workqueue_waiting": _round_trip_waiting(queue),
    }


def _round_trip(queue: Any) -> Op:
    """submit → read → complete → wait_result, one after another (the answer is already there
    when the waiter asks, so this is the queue's cost without any wake-up)."""

    async def op(index: int) -> None:
        request_id = f"rt-{index}"
        await queue.submit(request_id, PAYLOAD)
        [job] = await queue.read("w", count=1, block_ms=1000)
        await queue.complete(job, b"answer")
        result = await queue.wait_result(request_id, timeout_s=5)
        assert result is not None and result.ok, result

    return op


def _round_trip_waiting(queue: Any) -> Op:
    """The real path: the caller is already blocked in wait_result when the worker answers,
    so this includes the BLPOP wake-up and the token hand-on."""

    async def op(index: int) -> None:
        request_id = f"wt-{index}"
        await queue.submit(request_id, PAYLOAD)
        waiter = asyncio.create_task(queue.wait_result(request_id, timeout_s=5))
        [job] = await queue.read("w", count=1, block_ms=1000)
        await queue.complete(job, b"answer")
        result = await waiter
        assert result is not None and result.ok, result

    return op


def _result(samples: dict[str, list[float]], rounds: int) -> BenchResult:
    stats = {variant: Stats.of(values) for variant, values in samples.items()}
    rows = [_row(variant, stats[variant], stats["ping"]) for variant in VARIANTS]
    ratios = {}
    for variant in ("workqueue", "workqueue_waiting"):
        ratios[f"{variant}/raw_stream p50"] = ratio(stats[variant].p50, stats["raw_stream"].p50)
        ratios[f"{variant}/raw_stream p99"] = ratio(stats[variant].p99, stats["raw_stream"].p99)
        ratios[f"{variant}/ping p50"] = ratio(stats[variant].p50, stats["ping"].p50)
    ratios["raw_stream/ping p50"] = ratio(stats["raw_stream"].p50, stats["ping"].p50)
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios,
        columns=["variant", "n", "p50_ms", "p99_ms", "mean_ms", "ops_per_s", "x_ping_p50"],
        params={"rounds": rounds, "payload_bytes": len(PAYLOAD), "client": "redis.asyncio"},
        notes=[
            "raw_stream = XADD + XREADGROUP + XACK (3 round trips); workqueue = "
            "WorkQueue.submit + read + complete + wait_result; workqueue_waiting = the same "
            "with the caller already blocked in wait_result (BLPOP wake-up).",
            "Round trips to Redis: ping 1, raw_stream 3, workqueue 4 (Lua submit, XREADGROUP, "
            "MULTI answer+ack+delete, GET), workqueue_waiting 7 (a GET miss, the BLPOP, a GET "
            "and the token hand-on on the waiter's side, overlapping the worker's calls).",
            "docs/architecture.md (sync client, same machine type): PING ~0.12 ms; XADD+XREADGROUP+XACK "
            "p50 0.17 ms, p99 0.42 ms.",
        ],
    )


def _row(variant: str, stats: Stats, ping: Stats) -> dict[str, Any]:
    return {
        "variant": variant,
        "n": stats.n,
        "p50_ms": stats.p50 * 1e3,
        "p99_ms": stats.p99 * 1e3,
        "mean_ms": stats.mean * 1e3,
        "ops_per_s": 1 / stats.mean,
        "x_ping_p50": stats.p50 / ping.p50,
    }


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
