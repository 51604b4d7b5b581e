"""The data-parallel actors' update step (2 gloo ranks on Ray, DDP and FSDP2) against one process.

Why: ``trainer.strategy: ddp`` (and ``fsdp``, the same workers with the model and optimizer
sharded by FSDP2) moves the actor's forward and backward onto Ray workers. This
measures what one update costs that way on the default job's batch (32 prompts x 8 samples x 8
tokens, mini-batches of 128: two optimizer steps) with the shipped tiny policy, next to the
single-process ``Actor`` with 1 and with 2 torch threads: the DDP step adds the batch's trip
through the object store, the per-mini-batch all-reduce and Ray's call overhead, and splits
the compute; FSDP adds a weight all-gather per layer per forward and backward and a gradient
reduce-scatter. Also timed: fetching rank 0's weights for the push (once per version; for
FSDP every rank gathers them first). Before timing, one update on the same batch and row order
checks that each gives the single actor's weights (the max abs difference is recorded).

On a 2-core machine shared with other work, expect no speed-up: two ranks of one thread each
compete with everything else for the same two cores. Variants are interleaved (ABBA).

Usage: ``python bench/bench_ddp.py [--quick]`` (writes bench/results/ddp.json and ddp.md).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
from common import MODEL_DIR, BenchResult, Options, Stats, abba, progress, ratio, timed

NAME = "ddp"
TITLE = "Actor update: 2 DDP or FSDP ranks on Ray vs one process"
PROMPTS, SAMPLES, TOKENS, MINI_BATCH = 32, 8, 8, 128
VARIANTS = ("single_1thread", "single_2threads", "ddp_2ranks", "fsdp_2ranks")
STRATEGIES = ("ddp", "fsdp")


def run(options: Options) -> BenchResult:
    import ray
    import torch

    temp = tempfile.mkdtemp(prefix="rlf-ddp-", dir="/tmp")  # not /tmp/ray: others' clusters
    ray.init(
        address="local",
        num_cpus=4,  # logical: two placement groups of 2 ranks (idle while the other runs)
        object_store_memory=100 * 1024**2,
        include_dashboard=False,
        log_to_driver=options.verbose,
        _temp_dir=temp,
    )
    actors, start_s, weight_diff = {}, {}, {}
    try:
        for strategy in STRATEGIES:
            progress(f"starting 2 {strategy} ranks")
            start_s[strategy], actors[strategy] = timed(lambda s=strategy: _parallel_actor(s))
            weight_diff[strategy] = _equality_check(actors[strategy], torch)
            progress(f"{strategy} vs single: max |weight diff| {weight_diff[strategy]:.2e}")
        samples = _measure(actors, torch, options.pick(20, 6))
    finally:
        for actor in actors.values():
            actor.close()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    return _result(samples, start_s, weight_diff, options)


def _config(strategy: str):
    from rlfleet.common.config import load_config

    items = {
        "model.path": str(MODEL_DIR),
        "data.train_batch_size": PROMPTS,
        "rollout.n": SAMPLES,
        "rollout.max_tokens": TOKENS,
        "trainer.ppo_mini_batch_size": MINI_BATCH,
        "trainer.use_kl_loss": "false",
        "trainer.torch_threads": 1,
        "trainer.strategy": strategy,
        "trainer.world_size": 1 if strategy == "single" else 2,
    }
    return load_config(None, [f"{k}={v}" for k, v in items.items()], env={})


def _model():
    from rlfleet.model.model_io import load_causal_lm

    return load_causal_lm(MODEL_DIR)


def _parallel_actor(strategy: str):
    from rlfleet.trainer.ddp import parallel_actor

    return parallel_actor(_config(strategy), _model(), pad_id=0)


def _single_like(ddp, torch):
    """A single-process actor with rank 0's weights and optimizer state (``ddp``: either
    data-parallel actor)."""
    from rlfleet.trainer.actor import Actor

    model = _model()
    model.load_state_dict(ddp.model.state_dict())
    actor = Actor(_config("single"), model, pad_id=0)
    actor.apply_training_state(ddp.from_rank0("training_state"))
    return actor


def _batch(seed: int, torch):
    """The default job's shape: prompts like ``12+34=`` (7 tokens), 8-token responses."""
    from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask

    rng = random.Random(seed)
    rows = PROMPTS * SAMPLES
    batch = RolloutBatch(
        prompts=[[rng.randrange(3, 16) for _ in range(7)] for _ in range(rows)],
        responses=[
            [rng.randrange(3, 16) for _ in range(rng.randint(2, TOKENS))] for _ in range(rows)
        ],
    )
    mask = response_mask(batch.response_lengths())
    advantages = torch.tensor([rng.uniform(-1, 1) for _ in range(rows)])[:, None] * mask
    return batch, advantages, mask


def _equality_check(ddp, torch) -> float:
    single = _single_like(ddp, torch)
    batch, advantages, mask = _batch(0, torch)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    single.update(batch, advantages, mask)
    torch.manual_seed(0)
    ddp.update(batch, advantages, mask)
    mine = ddp.state_dict_for_rollout()
    return max(
        float((p.detach() - mine[n]).abs().max()) for n, p in single.model.named_parameters()
    )


def _measure(actors: dict, torch, rounds: int) -> dict[str, list[float]]:
    single = _single_like(actors["ddp"], torch)
    batch, advantages, mask = _batch(1, torch)
    fetches = [f"{strategy}_weight_fetch" for strategy in STRATEGIES]
    samples: dict[str, list[float]] = {name: [] for name in (*VARIANTS, *fetches)}
    for index, variant in abba(VARIANTS, rounds + 1):
        strategy = variant.removesuffix("_2ranks")
        if strategy in actors:
            actor = actors[strategy]
            elapsed, _ = timed(lambda a=actor: a.update(batch, advantages, mask))
            fetch, _ = timed(actor.state_dict_for_rollout)
            if index:
                samples[f"{strategy}_weight_fetch"].append(fetch)
        else:
            torch.set_num_threads(1 if variant == "single_1thread" else 2)
            elapsed, _ = timed(lambda: single.update(batch, advantages, mask))
        if index:  # round 0 warms up every variant
            samples[variant].append(elapsed)
    return samples


def _result(samples, start_s: dict, weight_diff: dict, options: Options) -> BenchResult:
    stats = {name: Stats.of(values) for name, values in samples.items()}
    base = stats["single_1thread"].p50
    rows = [_row(name, s, base) for name, s in stats.items()]
    ratios = {}
    for strategy in STRATEGIES:
        step = stats[f"{strategy}_2ranks"].p50
        ratios[f"{strategy}_2ranks / single_1thread (p50 step)"] = ratio(step, base)
        ratios[f"{strategy}_2ranks / single_2threads (p50 step)"] = ratio(
            step, stats["single_2threads"].p50
        )
    ratios["fsdp_2ranks / ddp_2ranks (p50 step)"] = ratio(
        stats["fsdp_2ranks"].p50, stats["ddp_2ranks"].p50
    )
    params = {
        "batch": f"{PROMPTS}x{SAMPLES} sequences, <= {TOKENS} response tokens",
        "mini_batch": MINI_BATCH,
        "model": MODEL_DIR.name,
        "rounds": options.pick(20, 6),
        "quick": options.quick,
    }
    notes = [
        f"DDP / FSDP vs single-process update on the same batch and row order: max |weight "
        f"diff| {weight_diff['ddp']:.2e} / {weight_diff['fsdp']:.2e} (float32; only the "
        "summation order differs).",
        f"Starting the 2 ranks (Ray actors, process group, model copies): DDP "
        f"{start_s['ddp']:.1f} s, FSDP {start_s['fsdp']:.1f} s, once per run.",
        "ddp_2ranks: the controller's call, batch through the object store, 2 ranks x 1 torch "
        "thread, one gloo all-reduce per mini-batch; ddp_weight_fetch: rank 0's parameters to "
        "the controller (once per pushed version). fsdp_2ranks: the same with the model and "
        "AdamW state sharded (FSDP2, one unit per decoder layer: all-gathers in forward and "
        "backward, a reduce-scatter of the gradients); fsdp_weight_fetch: every rank gathers "
        "the full weights, rank 0 sends them.",
        "2 cores shared with other work: no speed-up expected here; the point is the overhead.",
    ]
    return BenchResult(
        NAME,
        TITLE,
        ["variant", "n", "p50_ms", "p90_ms", "mean_ms", "x_single_1thread"],
        rows,
        ratios,
        params,
        notes,
    )


def _row(name: str, s: Stats, base: float) -> dict[str, Any]:
    return {
        "variant": name,
        "n": s.n,
        "p50_ms": s.p50 * 1e3,
        "p90_ms": s.p90 * 1e3,
        "mean_ms": s.mean * 1e3,
        "x_single_1thread": s.p50 / base,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 rounds instead of 20")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="results folder")
    parser.add_argument("-v", "--verbose", action="store_true", help="Ray workers' logs")
    args = parser.parse_args(argv)
    options = Options(quick=args.quick, verbose=args.verbose)
    machine, start, load_before = common.machine_info(), time.monotonic(), common.load_avg()
    result = run(options)
    result.seconds = time.monotonic() - start
    result.load_avg = {"before": load_before, "after": common.load_avg()}
    path = common.write_result(result, machine, args.out)
    print(f"{NAME}: " + "; ".join(f"{k} = {common.fmt(v)}" for k, v in result.ratios.items()))
    progress(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
