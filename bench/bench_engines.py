"""Rollout engines side by side: vLLM (``AsyncLLM``) against the transformers fallback.

Why: the rollout replica can run either backend (``rollout.backend``). This measures what the
choice costs on the default job's shape: 64 prompts from the held-out arithmetic set, ``n=8``
samples each, at most 8 new tokens, submitted as 64 concurrent ``generate`` calls (the way a
replica receives a GRPO batch). Both engines are started once and kept warm; generation rounds
alternate between them (ABBA), then weight updates (``load_weights`` with the model's own
weights, the size of a real update) and cache flushes alternate the same way.

Tokens counted are the tokens actually sampled (the trained model usually stops with EOS after
2-3 tokens), so tokens/s here is lower than with a fixed 32-token budget.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from common import MODEL_DIR, REPO, TEST_DATA, BenchResult, Options, Stats, abba, progress, ratio

NAME = "engines"
TITLE = "Rollout engines: vLLM vs transformers (hf)"
BACKENDS = ("vllm", "hf")
PROMPTS, SAMPLES, MAX_TOKENS = 64, 8, 8
NOTES_REF = (
    "docs/architecture.md (64 prompts x 8 samples x 32 tokens): vLLM bf16 ~19k tok/s, fp32 10-16k; "
    "transformers generate ~7-8k tok/s."
)
THREADS_NOTE = (
    "hf runs with torch_threads={threads} (--hf-threads; rollout.torch_threads defaults to 1); "
    "vLLM's CPU worker picks its own threads. On a busy 2-core machine 2 torch threads were "
    "~4x slower than 1 (OpenMP threads spinning while the other core is taken)."
)
FLUSH_NOTE = (
    "hf's flush_cache is a no-op (generate keeps no KV cache between calls); vLLM's is "
    "reset_prefix_cache in the engine process. load_weights on vLLM includes packing the state "
    "dict as safetensors bytes and the collective_rpc into the worker."
)
LOAD_NOTE = (
    "Both engines suffer from a busy machine, vLLM far more: at a load average of ~9 on 2 cores "
    "vLLM's own offline LLM.generate also ran only ~1k tok/s (32 tokens, ignore_eos) against "
    "docs/architecture.md's 10-16k. Read the ratio together with the load average below."
)


@dataclass
class EngineRun:
    """Everything measured for one backend."""

    backend: str
    engine: Any = None
    start_s: float = 0.0
    rounds: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens)
    updates: list[float] = field(default_factory=list)
    flushes: list[float] = field(default_factory=list)
    error: str | None = None


def run(options: Options) -> BenchResult:
    return asyncio.run(_bench(options))


async def _bench(options: Options) -> BenchResult:
    runs = {backend: EngineRun(backend) for backend in BACKENDS}
    try:
        for backend in BACKENDS:
            await _start(runs[backend], options)
        live = [b for b in BACKENDS if runs[b].engine is not None]
        if not live:
            raise RuntimeError("; ".join(f"{r.backend}: {r.error}" for r in runs.values()))
        prompts = _prompts(runs[live[0]].engine)
        await _generation_rounds([runs[b] for b in live], prompts, options)
        await _weight_rounds([runs[b] for b in live], options)
    finally:
        for engine_run in runs.values():
            await _close(engine_run)
    return _result(runs, options)


def _config(backend: str, options: Options) -> Any:
    from rlfleet.common.config import load_config

    overrides = [
        f"rollout.backend={backend}",
        f"model.path={MODEL_DIR}",
        f"model.dtype={options.dtype}",
        f"rollout.torch_threads={options.hf_threads}",
        f"rollout.max_tokens={MAX_TOKENS}",
        f"rollout.n={SAMPLES}",
    ]
    return load_config(REPO / "configs" / "default.yaml", overrides, env={})


async def _start(engine_run: EngineRun, options: Options) -> None:
    """Start one engine; a backend that cannot start is reported, the other still runs."""
    from rlfleet.rollout.engines.factory import make_engine

    if not options.verbose:  # vLLM logs every step of its start-up to stdout at INFO
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    progress(f"engines: starting {engine_run.backend} ({options.dtype})")
    start = time.perf_counter()
    try:
        engine = make_engine(_config(engine_run.backend, options))
        await engine.start()
    except Exception as exc:  # noqa: BLE001 - e.g. vLLM missing on this machine
        engine_run.error = repr(exc)
        progress(f"engines: {engine_run.backend} failed to start: {exc!r}")
        return
    engine_run.engine, engine_run.start_s = engine, time.perf_counter() - start
    progress(f"engines: {engine_run.backend} ready in {engine_run.start_s:.1f}s")


async def _close(engine_run: EngineRun) -> None:
    if engine_run.engine is not None:
        await engine_run.engine.close()
        engine_run.engine = None


def _prompts(engine: Any) -> list[list[int]]:
    from rlfleet.model.model_io import encode_prompt

    with open(TEST_DATA) as handle:
        rows = [json.loads(line) for line, _ in zip(handle, range(PROMPTS), strict=False)]
    return [encode_prompt(engine.tokenizer, row["prompt"]) for row in rows]


async def _generation_rounds(
    runs: list[EngineRun], prompts: list[list[int]], options: Options
) -> None:
    rounds = options.pick(full=8, quick=2)
    for engine_run in runs:  # warm-up: first-call compilation, thread pools, allocator
        await _one_round(engine_run.engine, prompts, f"warm-{engine_run.backend}")
    by_name = {r.backend: r for r in runs}
    for index, backend in abba(list(by_name), rounds):
        seconds, tokens = await _one_round(by_name[backend].engine, prompts, f"{backend}-{index}")
        by_name[backend].rounds.append((seconds, tokens))
        progress(f"engines: round {index + 1}/{rounds} {backend}: {tokens / seconds:,.0f} tok/s")


async def _one_round(engine: Any, prompts: list[list[int]], tag: str) -> tuple[float, int]:
    """All prompts at once, as concurrent generate calls; (seconds, sampled tokens)."""
    from rlfleet.rollout.types import SamplingParams

    sampling = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS)
    start = time.perf_counter()
    calls = [engine.generate(f"{tag}-{i}", p, sampling) for i, p in enumerate(prompts)]
    answers = await asyncio.gather(*calls)
    seconds = time.perf_counter() - start
    assert all(len(a) == SAMPLES for a in answers), "an engine returned the wrong sample count"
    return seconds, sum(len(c.token_ids) for answer in answers for c in answer)


async def _weight_rounds(runs: list[EngineRun], options: Options) -> None:
    """load_weights then flush_cache, alternating engines; the full tiny model each time."""
    import safetensors.torch

    state_dict = safetensors.torch.load_file(str(MODEL_DIR / "model.safetensors"))
    by_name = {r.backend: r for r in runs}
    for _, backend in abba(list(by_name), options.pick(full=10, quick=3)):
        engine_run = by_name[backend]
        start = time.perf_counter()
        await engine_run.engine.load_weights(state_dict)
        middle = time.perf_counter()
        await engine_run.engine.flush_cache()
        engine_run.updates.append(middle - start)
        engine_run.flushes.append(time.perf_counter() - middle)
    progress("engines: weight updates and flushes done")


def _row(engine_run: EngineRun) -> dict[str, Any]:
    if not engine_run.rounds:
        return {"backend": engine_run.backend, "tokens_per_s": float("nan")}
    seconds = sum(s for s, _ in engine_run.rounds)
    tokens = sum(t for _, t in engine_run.rounds)
    samples = len(engine_run.rounds) * PROMPTS * SAMPLES
    return {
        "backend": engine_run.backend,
        "start_s": engine_run.start_s,
        "tokens_per_s": tokens / seconds,
        "samples_per_s": samples / seconds,
        "round_p50_s": Stats.of([s for s, _ in engine_run.rounds]).p50,
        "best_round_tok_s": max(t / s for s, t in engine_run.rounds),
        "tokens_per_sample": tokens / samples,
        "load_weights_p50_ms": Stats.of(engine_run.updates).p50 * 1e3,
        "flush_p50_ms": Stats.of(engine_run.flushes).p50 * 1e3,
    }


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    if not all(rows[b].get("start_s") is not None for b in BACKENDS):
        return {}
    vllm, hf = rows["vllm"], rows["hf"]
    return {
        "vllm/hf tokens/s": ratio(vllm["tokens_per_s"], hf["tokens_per_s"]),
        "vllm/hf load_weights time": ratio(vllm["load_weights_p50_ms"], hf["load_weights_p50_ms"]),
        "vllm/hf flush time": ratio(vllm["flush_p50_ms"], hf["flush_p50_ms"]),
        "vllm/hf start-up time": ratio(vllm["start_s"], hf["start_s"]),
    }


def _result(runs: dict[str, EngineRun], options: Options) -> BenchResult:
    rows = {backend: _row(engine_run) for backend, engine_run in runs.items()}
    notes = [NOTES_REF, THREADS_NOTE.format(threads=options.hf_threads), LOAD_NOTE, FLUSH_NOTE]
    notes += [f"{r.backend} failed: {r.error}" for r in runs.values() if r.error]
    params = {"prompts": PROMPTS, "n": SAMPLES, "max_tokens": MAX_TOKENS, "dtype": options.dtype}
    params |= {
        "hf_threads": options.hf_threads,
        "rounds": len(runs["hf"].rounds),
        "weight_updates": len(runs["hf"].updates),
    }
    params["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=list(rows.values()),
        ratios=_ratios(rows),
        notes=notes,
        columns=[
            "backend",
            "tokens_per_s",
            "best_round_tok_s",
            "samples_per_s",
            "round_p50_s",
            "tokens_per_sample",
            "load_weights_p50_ms",
            "flush_p50_ms",
            "start_s",
        ],
        params=params,
    )


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
