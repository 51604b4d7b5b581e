"""Weight updates every step with requests in flight: ``rollout.update_policy`` restart, finish
and keep against no updates at all, side by side on one replica.

Why: with long generations an update lands while most requests are mid-generation (issue 20).
``restart`` throws away what they decoded and runs them again, ``finish`` holds the update (and
every new request) until the longest one is done, ``keep`` stops them where they are and
continues them under the new weights. The issue's target: zero decoded tokens lost per update
with ``keep``, and throughput under per-step updates within 10 % of no updates.

Set-up: the replica core (``rlfleet.rollout.replica.Replica``: phase, in-flight gate, weight
updater, the engine; a benchmark-owned embedded Redis) in this process, one engine per backend
(transformers ``generate``; vLLM ``AsyncLLM`` too when it is installed). The model is a copy
of the tiny policy that takes ``<unk>`` (which it never samples) as end-of-sequence and has
room for ``MAX_MODEL_LEN`` positions (RoPE: the weights are unchanged), so every completion is
as long as its ``max_tokens`` and an update lands mid-generation. ``CLIENTS`` closed-loop
clients each send one request after another (one sample, temperature 1, ``MAX_TOKENS``
tokens) for ``window`` seconds; an updater pushes a new version every ``PERIOD_S`` (the next
push starts ``PERIOD_S`` after the previous one started, or at once if that one took longer),
alternating two weight sets. The variants share the engine; the replica's policy is switched
between rounds (ABBA order), and versions only go up.

Measured per variant over the rounds: completion tokens/s (tokens of the requests answered
inside the window / the window), request latency p50/p99 (same requests), updates and their
latency (push start to the replica serving the new version), decoded tokens thrown away per
update (the replica's ``UpdateStats.tokens_discarded``: tokens generated, then discarded by a
restart), and for ``keep`` the share of completions whose tokens carry more than one weight
version. ``restart`` runs with ``rollout.drain_timeout_s=0`` (abort at once); with the default
30 s it waits for requests of this length to finish, i.e. behaves like ``finish``.

Usage: ``python bench/bench_inflight.py [--quick]`` (or ``run_all.py --only
inflight``); writes ``bench/results/inflight.json`` and ``inflight.md``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import MODEL_DIR, BenchResult, Options, Stats, abba, progress, ratio

NAME = "inflight"
TITLE = "Weight updates every step with requests in flight: restart vs finish vs keep"
VARIANTS = ("none", "restart", "finish", "keep")
CLIENTS = 8
MAX_TOKENS = 192
MAX_MODEL_LEN = 256
PERIOD_S = 1.5
WINDOW_S = 25
UNK = 3
COLUMNS = [
    "engine",
    "variant",
    "tok_per_s",
    "vs_none",
    "p50_s",
    "p99_s",
    "requests",
    "updates",
    "update_p50_s",
    "lost_tok_per_update",
    "restarted",
    "kept_tok_per_update",
    "multi_version_share",
    "rows_per_call",
]


@dataclass
class Round:
    """What one variant did in one round."""

    tokens: float = 0.0
    latencies: list[float] = field(default_factory=list)
    completions: int = 0
    multi_version: int = 0
    updates: list[float] = field(default_factory=list)
    discarded: int = 0
    restarted: int = 0
    kept: int = 0
    window_s: float = 0.0
    engine_calls: int = 0
    """``model.generate`` calls (hf; vLLM batches inside and reports 0)."""
    bad_versions: int = 0
    """Completions whose token versions go down (must stay 0)."""


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    options.work_dir.mkdir(parents=True, exist_ok=True)
    model = long_model(options.work_dir / "update-policy-model")
    engines = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    with EmbeddedRedis(options.work_dir / "update-policy-redis") as server:
        for backend in engines:
            try:
                rounds = asyncio.run(_measure_engine(backend, model, server.url, options))
            except Exception as exc:  # noqa: BLE001 - the other engine's numbers still count
                if backend == "hf":
                    raise
                notes.append(f"{backend}: failed ({exc!r}); no numbers for it")
                continue
            rows += _rows(backend, rounds)
    return _result(rows, notes, options)


def long_model(target: Path) -> Path:
    """The tiny policy with ``<unk>`` as end-of-sequence and ``MAX_MODEL_LEN`` positions."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(MODEL_DIR, target)
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((target / name).read_text())
        raw["eos_token_id"] = UNK
        if name == "config.json":
            raw["max_position_embeddings"] = MAX_MODEL_LEN
        (target / name).write_text(json.dumps(raw, indent=2))
    tok = json.loads((target / "tokenizer_config.json").read_text())
    tok["eos_token"] = "<unk>"
    (target / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return target


def _config(backend: str, model: Path, redis_url: str, options: Options):
    from rlfleet.common.config import load_config

    overrides = [
        f"model.path={model}",
        f"rollout.backend={backend}",
        f"model.dtype={options.dtype}",
        f"rollout.max_model_len={MAX_MODEL_LEN}",
        f"rollout.torch_threads={options.hf_threads}",
        f"redis_url={redis_url}",
        "rollout.hf_batch_wait_ms=5",
    ]
    return load_config(overrides=overrides, env={})


async def _measure_engine(
    backend: str, model: Path, redis_url: str, options: Options
) -> dict[str, list[Round]]:
    from redis.asyncio import Redis

    from rlfleet.common.keys import Keys
    from rlfleet.rollout.engines.factory import make_engine
    from rlfleet.rollout.replica import Replica

    config = _config(backend, model, redis_url, options)
    engine = make_engine(config)
    redis = Redis.from_url(redis_url)
    core = Replica(
        config, engine, redis, Keys(f"bench{uuid.uuid4().hex[:8]}"), f"up-{backend}", "127.0.0.1:1"
    )
    progress(f"inflight: starting the {backend} engine")
    try:
        await core.start()
        pushes = Pushes(model)
        await core.update_weights(*pushes.next())
        prompts = [engine.encode(f"{a}+{b}=") for a in range(10, 40) for b in range(10, 40)]
        window = options.pick(full=WINDOW_S, quick=6)
        await _round(core, prompts, "none", min(window, 5), pushes)  # warm-up
        rounds: dict[str, list[Round]] = {v: [] for v in VARIANTS}
        for index, variant in abba(VARIANTS, options.pick(full=2, quick=1)):
            progress(f"inflight: {backend} round {index} {variant}")
            rounds[variant].append(await _round(core, prompts, variant, window, pushes))
        return rounds
    finally:
        await asyncio.wait_for(core.shutdown(grace_s=0), 60)
        await engine.close()
        await redis.aclose()


class Pushes:
    """The next weight update: two weight sets taking turns, versions going up."""

    def __init__(self, model: Path) -> None:
        import torch
        from safetensors.torch import load_file

        base = load_file(str(model / "model.safetensors"))
        gen = torch.Generator().manual_seed(7)
        moved = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
        self._sets, self.version = [base, moved], 0

    def next(self) -> tuple[Any, Any]:
        from rlfleet.model import weights

        self.version += 1
        return weights.encode(self._sets[self.version % 2], self.version)


async def _round(core, prompts: list[list[int]], variant: str, window_s: float, pushes) -> Round:
    """``CLIENTS`` clients for ``window_s``, with updates every ``PERIOD_S`` unless ``none``."""
    rollout = core.config.rollout
    rollout.update_policy = "restart" if variant == "none" else variant
    rollout.drain_timeout_s = 0.0 if variant == "restart" else 30.0
    stats, before = core.inflight.gate.stats, _counters(core.inflight.gate.stats)
    calls = core.engine.batches
    ready = [pushes.next() for _ in range(int(window_s / PERIOD_S) + 4)]  # encoded beforehand
    result, rng = Round(window_s=window_s), random.Random(pushes.version)
    start = time.perf_counter()
    deadline = start + window_s
    clients = [
        asyncio.create_task(_client(core, prompts, rng, deadline, result)) for _ in range(CLIENTS)
    ]
    if variant != "none":
        await _push_until(core, ready, deadline, result)
    await asyncio.gather(*clients)
    after = _counters(stats)
    result.discarded, result.restarted, result.kept = (
        a - b for a, b in zip(after, before, strict=True)
    )
    result.engine_calls = core.engine.batches - calls
    return result


def _counters(stats) -> tuple[int, int, int]:
    return stats.tokens_discarded, stats.requests_restarted, stats.tokens_kept


async def _client(core, prompts, rng: random.Random, deadline: float, result: Round) -> None:
    """One request after another until the deadline. A request that ends after it counts
    with the share of its time inside the window (no edge bias from long requests)."""
    from rlfleet.rollout.types import GenerateRequest, SamplingParams

    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=MAX_TOKENS)
    while (sent := time.perf_counter()) < deadline:
        request = GenerateRequest(uuid.uuid4().hex, sampling, prompt_token_ids=rng.choice(prompts))
        answer = await core.generate_direct(request)
        done = time.perf_counter()
        share = min(1.0, (deadline - sent) / (done - sent))
        result.latencies.append(done - sent)
        for completion in answer.completions:
            versions = completion.weight_versions
            result.tokens += len(completion.token_ids) * share
            result.completions += 1
            result.multi_version += len(set(versions)) > 1
            result.bad_versions += versions != sorted(versions)


async def _push_until(core, ready: list, deadline: float, result: Round) -> None:
    """A push every ``PERIOD_S`` (or right after the previous one if it took longer)."""
    next_at = time.perf_counter() + PERIOD_S
    while ready and next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        started = time.perf_counter()
        await core.update_weights(*ready.pop(0))
        result.updates.append(time.perf_counter() - started)
        next_at = started + PERIOD_S


def _rows(backend: str, rounds: dict[str, list[Round]]) -> list[dict[str, Any]]:
    rows = [_row(backend, variant, samples) for variant, samples in rounds.items()]
    base = rows[0]["tok_per_s"]
    for row in rows:
        row["vs_none"] = ratio(row["tok_per_s"], base)
    return rows


def _row(backend: str, variant: str, samples: list[Round]) -> dict[str, Any]:
    latencies = [x for r in samples for x in r.latencies]
    updates = [x for r in samples for x in r.updates]
    n_updates = len(updates)
    completions = sum(r.completions for r in samples)
    lat = Stats.of(latencies) if latencies else None
    return {
        "engine": backend,
        "variant": variant,
        "tok_per_s": sum(r.tokens for r in samples) / sum(r.window_s for r in samples),
        "p50_s": lat.p50 if lat else float("nan"),
        "p99_s": lat.p99 if lat else float("nan"),
        "requests": len(latencies),
        "updates": n_updates,
        "update_p50_s": Stats.of(updates).p50 if updates else float("nan"),
        "lost_tok_per_update": ratio(sum(r.discarded for r in samples), n_updates),
        "restarted": sum(r.restarted for r in samples),
        "kept_tok_per_update": ratio(sum(r.kept for r in samples), n_updates),
        "multi_version_share": ratio(sum(r.multi_version for r in samples), completions),
        "bad_versions": sum(r.bad_versions for r in samples),
        "rows_per_call": ratio(
            sum(r.tokens for r in samples) / MAX_TOKENS, sum(r.engine_calls for r in samples)
        ),
        "rounds": len(samples),
    }


def _result(rows: list[dict[str, Any]], notes: list[str], options: Options) -> BenchResult:
    ratios: dict[str, float] = {}
    for row in rows:
        if row["variant"] != "none":
            ratios[f"{row['engine']} {row['variant']} tok/s vs none"] = row["vs_none"]
    for row in rows:
        if row["variant"] == "keep":
            ratios[f"{row['engine']} keep lost tokens per update"] = row["lost_tok_per_update"]
    notes = [*_verdicts(rows), *notes, *_method_notes()]
    params = {
        "clients": CLIENTS,
        "max_tokens": MAX_TOKENS,
        "period_s": PERIOD_S,
        "window_s": options.pick(full=WINDOW_S, quick=6),
        "rounds": options.pick(full=2, quick=1),
        "max_model_len": MAX_MODEL_LEN,
        "dtype": options.dtype,
    }
    return BenchResult(NAME, TITLE, COLUMNS, rows, ratios, params, notes)


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, per engine, said plainly."""
    out = []
    for row in (r for r in rows if r["variant"] == "keep"):
        lost, vs = row["lost_tok_per_update"], row["vs_none"]
        zero = lost == 0
        fast = vs >= 0.9
        out.append(
            f"{row['engine']}: keep lost {lost:.3g} decoded tokens per update "
            f"(target 0: {'met' if zero else 'missed'}); keep throughput under an update every "
            f"{PERIOD_S} s = {vs:.3f} x no updates (target >= 0.9: {'met' if fast else 'missed'})"
            f"; completions with token versions going down: {row['bad_versions']}."
        )
    return out


def _method_notes() -> list[str]:
    return [
        f"One replica core in this process per engine, {CLIENTS} closed-loop clients, one "
        f"sample per request at temperature 1, {MAX_TOKENS} tokens each (the model's copy "
        "never ends early), an update every "
        f"{PERIOD_S} s (alternating two weight sets) except in 'none'. Variants share the "
        "warm engine and are interleaved ABBA.",
        "tok_per_s: completion tokens answered / the window (a request still running at the "
        "window's end counts with the share of its time inside it); p50/p99: request latency "
        "(a restarted request's includes its rerun); "
        "update_p50_s: push start to the new version serving (finish waits for the longest "
        "request; new requests wait meanwhile).",
        "lost_tok_per_update: decoded tokens thrown away by restarts / updates "
        "(UpdateStats.tokens_discarded); kept_tok_per_update: tokens carried across an update "
        "by keep; multi_version_share: completions whose tokens carry more than one version; "
        "rows_per_call (hf): completions' worth of tokens per model.generate call (8 = every "
        "client in one full-length batch; a continuation's call decodes only the rest of its "
        "budget, so keep reads lower for the same batching).",
        "restart runs with rollout.drain_timeout_s=0; with the default (30 s) it waits for "
        "requests this short to finish, like finish.",
    ]


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
