"""One training step's generation through the router: 32 Generate calls vs one GenerateBatch.

Why: a step used to send one Generate per prompt. Each costs the router about ten Redis round
trips (result lookup, snapshot, claim, submit, wait, release) and reaches its replica on its
own, so the hf engine's batching window splits the step into several ``generate`` calls.
GenerateBatch routes the step from one snapshot and gives each replica one queue entry holding
its share, which its engine runs as one batch. Both variants run against the same real fleet
(embedded Redis, ``rlfleet router``, two hf replicas as processes), interleaved (ABBA).

Redis commands are the server's ``INFO commandstats`` delta around each round, so they include
the replicas' own traffic (reads, answers, heartbeats) and not only the router's.

Usage: ``python bench/bench_generate.py [--quick]`` (writes bench/results/generate.json/.md).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import common
from common import MODEL_DIR, BenchResult, Options, Stats, abba, progress, ratio

NAME = "generate"
TITLE = "A step's generation through the router: per-prompt Generate vs GenerateBatch"
VARIANTS = ("per_prompt", "batch")
PROMPTS, SAMPLES, TOKENS, REPLICAS = 32, 8, 8, 2


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    rounds = options.pick(full=6, quick=2)
    options.work_dir.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis(options.work_dir / "generate-redis") as server:
        procs, address = _start_fleet(server.url, options)
        try:
            samples = asyncio.run(_measure(server.url, address, rounds))
        finally:
            for proc in procs:
                common.stop_child(proc, group=True)
    return _result(samples, rounds)


def _start_fleet(redis_url: str, options: Options) -> tuple[list[subprocess.Popen], str]:
    """The router and REPLICAS hf replicas of a fresh cluster, each in its own process group."""
    from rlfleet.common.redis_server import free_port

    cluster, port, logs = f"bench{uuid.uuid4().hex[:8]}", free_port(), options.work_dir
    base = [f"redis_url={redis_url}", f"cluster={cluster}", f"run_dir={logs}"]
    procs = [
        _spawn(["rlfleet.rollout.router.main", "--port", str(port), *base], logs / "router.log")
    ]
    for i in range(REPLICAS):
        argv = [
            "rlfleet.rollout.main",
            "--replica-id",
            f"b{i}",
            "--port",
            "0",
            *base,
            f"model.path={MODEL_DIR}",
            "rollout.backend=hf",
            f"model.dtype={options.dtype}",
            f"rollout.torch_threads={options.hf_threads}",
        ]
        procs.append(_spawn(argv, logs / f"replica-{i}.log"))
    try:
        _wait_serving(redis_url, cluster, procs)
    except BaseException:
        for proc in procs:
            common.stop_child(proc, group=True)
        raise
    return procs, f"127.0.0.1:{port}"


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _wait_serving(redis_url: str, cluster: str, procs: list[subprocess.Popen]) -> None:
    import redis

    from rlfleet.common.keys import Keys

    keys, client, deadline = Keys(cluster), redis.Redis.from_url(redis_url), time.time() + 300
    try:
        while time.time() < deadline:
            states = [client.hget(keys.replica(f"b{i}"), "state") for i in range(REPLICAS)]
            if all(s == b"serving" for s in states):
                progress(f"generate: router and {REPLICAS} replicas serving")
                return
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a fleet process exited early (see bench/results/work)")
            time.sleep(0.2)
    finally:
        client.close()
    raise TimeoutError("replicas not serving after 300 s")


async def _measure(redis_url: str, address: str, rounds: int) -> dict[str, list[tuple]]:
    import redis.asyncio as aioredis

    from rlfleet.rollout.client import RolloutClient

    redis = aioredis.Redis.from_url(redis_url)
    samples: dict[str, list[tuple]] = {v: [] for v in VARIANTS}
    try:
        async with RolloutClient(address) as client:
            await client.wait_ready()
            for variant in VARIANTS:  # warm-up: connections, scripts, first model calls
                await _step(client, variant)
            for index, variant in abba(VARIANTS, rounds):
                before, began = await _commands(redis), time.perf_counter()
                await _step(client, variant)
                seconds = time.perf_counter() - began
                samples[variant].append((seconds, await _commands(redis) - before - 1))
                progress(f"generate: round {index} {variant} {seconds:.3f} s")
    finally:
        await redis.aclose()
    return samples


async def _step(client: Any, variant: str) -> None:
    """One step's generation: PROMPTS prompts x SAMPLES samples x TOKENS tokens."""
    from rlfleet.rollout.types import GenerateRequest, SamplingParams

    sampling = SamplingParams(n=SAMPLES, max_tokens=TOKENS, temperature=1.0)
    tag = uuid.uuid4().hex[:8]
    requests = [
        GenerateRequest(
            f"{tag}-{i}", sampling, prompt_text=f"{10 + i}+{20 + 3 * i}=", session_id=f"{tag}-g{i}"
        )
        for i in range(PROMPTS)
    ]
    if variant == "batch":
        results = await client.generate_batch(requests)
    else:
        results = await asyncio.gather(*(client.generate(r) for r in requests))
    assert len(results) == PROMPTS and all(len(r.completions) == SAMPLES for r in results)


async def _commands(redis: Any) -> int:
    """Commands the server has run so far (this INFO call included)."""
    stats = await redis.info("commandstats")
    return sum(int(entry["calls"]) for entry in stats.values())


def _result(samples: dict[str, list[tuple]], rounds: int) -> BenchResult:
    seconds = {v: Stats.of([s for s, _ in samples[v]]) for v in VARIANTS}
    commands = {v: sum(c for _, c in samples[v]) / len(samples[v]) for v in VARIANTS}
    rows = [
        {
            "variant": v,
            "rounds": seconds[v].n,
            "p50_s": seconds[v].p50,
            "mean_s": seconds[v].mean,
            "redis_commands": commands[v],
        }
        for v in VARIANTS
    ]
    ratios = {
        "per_prompt/batch seconds p50": ratio(seconds["per_prompt"].p50, seconds["batch"].p50),
        "per_prompt/batch redis commands": ratio(commands["per_prompt"], commands["batch"]),
    }
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios,
        columns=["variant", "rounds", "p50_s", "mean_s", "redis_commands"],
        params={
            "rounds": rounds,
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "tokens": TOKENS,
            "replicas": REPLICAS,
            "backend": "hf",
        },
        notes=[
            "per_prompt = 32 concurrent Rollout.Generate calls to the router (one session each); "
            "batch = one Rollout.GenerateBatch with the same 32 requests.",
            "redis_commands = INFO commandstats delta per round, server-wide (router and "
            "replicas, heartbeats included; commands run inside Lua scripts count too).",
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds per variant, not 6")
    parser.add_argument("--hf-threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    options = Options(quick=args.quick, hf_threads=args.hf_threads, work_dir=args.out / "work")
    machine, started, load_before = common.machine_info(), time.monotonic(), common.load_avg()
    result = run(options)
    result.seconds = time.monotonic() - started
    result.load_avg = {"before": load_before, "after": common.load_avg()}
    path = common.write_result(result, machine, args.out)
    progress(f"generate: -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
