"""Weight push to 1, 2 and 4 real rollout replicas, as a multiple of memcpy of the same bytes.

Why: after every training step the trainer pushes the new weights to every replica, in
parallel. A push is encode (one copy, one checksum) → serialize once → gRPC client streams
to every replica → each replica writes chunks into one buffer, verifies, loads into its engine
and flushes. The yardstick is memcpy of the same number of bytes measured in the same run
(a torch copy into a warm buffer): a push can hardly beat a few of those, and 4 replicas should
cost little more than 1 (target: 4 replicas <= 1.5x the time of 1).

Two transports, both the trainer's ``GrpcWeightTransport``: ``push xN`` streams the bytes to
each replica over gRPC (replicas on other machines); ``shm xN`` writes them once into a
``/dev/shm`` file and sends each replica only the header naming it (replicas on the trainer's
machine, the default there: ``trainer.weight_shared_memory``).

Two models: the committed tiny policy (~2 MiB), and a random Qwen2 of ~64 MiB built in the
work folder (same tokenizer), so fixed costs stop mattering. Pushes go through the trainer's
own ``GrpcWeightTransport``. Replicas are real ``python -m rlfleet.rollout.main`` processes
(hf backend, an embedded Redis started here), stopped with SIGTERM (then SIGKILL) whatever
happens. Variants are interleaved (ABBA) so machine load hits them alike.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import (
    MODEL_DIR,
    REPO,
    BenchResult,
    Options,
    Stats,
    abba,
    progress,
    ratio,
    stop_child,
    timed,
    wait_serving,
)

NAME = "weights"
TITLE = "Weight push to 1, 2 and 4 replicas vs memcpy"
FANOUTS = (1, 2, 4)
START_TIMEOUT_S = 300.0
CHUNK_BYTES = 4 * 2**20


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    options.work_dir.mkdir(parents=True, exist_ok=True)
    models = {"tiny": MODEL_DIR, "64MiB": _synthetic_model(options.work_dir / "push-64mib")}
    rows: dict[str, dict[str, Any]] = {}
    with EmbeddedRedis(options.work_dir / "weights-redis") as server:
        for label, path in models.items():
            rows.update(_measure_model(label, path, server.url, options))
    return _result(rows, options)


def _measure_model(label: str, path: Path, redis_url: str, options: Options) -> dict:
    replicas = [_start_replica(redis_url, path, f"{label}-{i}", options) for i in range(4)]
    try:
        samples = asyncio.run(_measure(replicas, path, options))
    finally:
        for replica in replicas:
            stop_child(replica.proc, grace_s=15)
    return {f"{label}/{key}": _row(label, key, values) for key, values in samples.items()}


class Replica:
    """A replica process we started, where it listens, and where its log goes."""

    def __init__(self, proc: subprocess.Popen, address: str, log_path: Path) -> None:
        self.proc, self.address, self.log_path = proc, address, log_path


def _start_replica(redis_url: str, model: Path, replica_id: str, options: Options) -> Replica:
    from rlfleet.common.redis_server import free_port

    port, log_path = free_port(), options.work_dir / f"replica-{replica_id}.log"
    command = [
        sys.executable,
        "-m",
        "rlfleet.rollout.main",
        "--replica-id",
        replica_id,
        "--port",
        str(port),
        f"redis_url={redis_url}",
        "cluster=bench",
        "rollout.backend=hf",
        f"model.path={model}",
        f"model.dtype={options.dtype}",
        f"rollout.torch_threads={options.hf_threads}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    progress(f"weights: replica {replica_id} pid {proc.pid} starting on port {port}")
    return Replica(proc, f"127.0.0.1:{port}", log_path)


async def _measure(replicas: list[Replica], model: Path, options: Options) -> dict[str, list]:
    from rlfleet.rollout.client import PreparedUpdate, RolloutClient
    from rlfleet.trainer.weight_transport import GrpcWeightTransport

    state_dict = _state_dict(model, options.dtype)
    transports = {
        "push": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES),
        "shm": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, True),
    }
    clients = [RolloutClient(r.address) for r in replicas]
    try:
        targets = [await _wait_serving(c, r) for c, r in zip(clients, replicas, strict=True)]
        pushes = [f"{kind} x{n}" for kind in transports for n in FANOUTS]
        variants = ["memcpy", "encode", *pushes]
        samples: dict[str, list] = {v: [] for v in variants}
        version = 0
        for index, variant in abba(variants, options.pick(full=10, quick=3) + 1):
            version += 1  # every replica sees versions only go up
            sample = await _once(variant, state_dict, transports, targets, version)
            if index:  # round 0 is a warm-up
                samples[variant].append(sample)
        return samples
    finally:
        for transport in transports.values():
            await transport.close()
        for client in clients:
            await client.close()


async def _once(variant, state_dict, transports, targets, version: int) -> dict[str, float]:
    if variant == "memcpy":
        return await asyncio.to_thread(_memcpy_once, state_dict)
    if variant == "encode":
        return await asyncio.to_thread(_encode_once, state_dict)
    kind, fanout = variant.split(" x")
    transport, fanout = transports[kind], int(fanout)
    start = time.perf_counter()
    results = await transport.push(state_dict, version, True, targets[:fanout])
    seconds = time.perf_counter() - start
    if not all(r.ok and r.version == version for r in results):
        raise RuntimeError(f"push of v{version} failed: {[r.error for r in results]}")
    return {
        "seconds": seconds,
        "bytes": results[0].bytes,
        "slowest_replica_s": max(r.seconds for r in results),
    }


def _memcpy_once(state_dict: dict[str, Any]) -> dict[str, float]:
    """A plain (numpy, single-threaded) copy of as many bytes as the payload, into a warm
    buffer."""
    import numpy

    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    source, target = numpy.ones(nbytes, numpy.uint8), numpy.zeros(nbytes, numpy.uint8)
    numpy.copyto(target, source)  # touch every page first
    seconds, _ = timed(lambda: numpy.copyto(target, source))
    return {"seconds": seconds, "bytes": nbytes}


def _encode_once(state_dict: dict[str, Any]) -> dict[str, float]:
    """The trainer's share, done once per push: encode (copy + checksum) and serialize."""
    from rlfleet.model import weights
    from rlfleet.rollout.client import PreparedUpdate

    start = time.perf_counter()
    header, payload = weights.encode(state_dict, version=1)
    PreparedUpdate.of(header, payload, CHUNK_BYTES)
    return {"seconds": time.perf_counter() - start, "bytes": header.total_bytes}


async def _wait_serving(client: Any, replica: Replica) -> Any:
    return await wait_serving(client, replica.proc, replica.log_path, "", START_TIMEOUT_S)


def _state_dict(model: Path, dtype: str) -> dict[str, Any]:
    import safetensors.torch
    import torch

    loaded = safetensors.torch.load_file(str(model / "model.safetensors"))
    return {name: tensor.to(getattr(torch, dtype)) for name, tensor in loaded.items()}


def _synthetic_model(path: Path) -> Path:
    """A random Qwen2 of ~64 MiB in float32 (the tiny policy's tokenizer), built once."""
    if (path / "model.safetensors").exists():
        return path
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config.from_pretrained(MODEL_DIR)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 512, 1152, 6
    config.num_attention_heads = config.num_key_value_heads = 8
    config.layer_types = ["full_attention"] * 6
    Qwen2ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(MODEL_DIR / name, path / name)
    progress(f"weights: built a random ~64 MiB Qwen2 in {path}")
    return path


def _row(model: str, variant: str, samples: list[dict[str, float]]) -> dict[str, Any]:
    seconds = Stats.of([s["seconds"] for s in samples])
    mib = samples[0]["bytes"] / 2**20
    row = {
        "model": model,
        "variant": variant,
        "n": seconds.n,
        "MiB": mib,
        "p50_ms": seconds.p50 * 1e3,
        "p90_ms": seconds.p90 * 1e3,
        "MiB_per_s": mib / seconds.p50,
    }
    if "slowest_replica_s" in samples[0]:
        row["slowest_replica_p50_ms"] = Stats.of([s["slowest_replica_s"] for s in samples]).p50
        row["slowest_replica_p50_ms"] *= 1e3
    return row


def _result(rows: dict[str, dict[str, Any]], options: Options) -> BenchResult:
    for key, row in rows.items():
        row["x_memcpy"] = ratio(row["p50_ms"], rows[f"{key.split('/')[0]}/memcpy"]["p50_ms"])
    return BenchResult(
        name=NAME,
        title=TITLE,
        rows=list(rows.values()),
        ratios=_ratios(rows),
        notes=NOTES,
        columns=[
            "model",
            "variant",
            "n",
            "MiB",
            "p50_ms",
            "p90_ms",
            "x_memcpy",
            "MiB_per_s",
            "slowest_replica_p50_ms",
        ],
        params={
            "dtype": options.dtype,
            "backend": "hf",
            "chunk_MiB": CHUNK_BYTES // 2**20,
            "transport": "GrpcWeightTransport: gRPC stream (push), /dev/shm (shm)",
            "quick": options.quick,
        },
    )


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    ms = {key: row["p50_ms"] for key, row in rows.items()}
    return {
        "64MiB shm: 4 replicas / 1 replica (target <= 1.5)": ratio(
            ms["64MiB/shm x4"], ms["64MiB/shm x1"]
        ),
        "64MiB stream: 4 replicas / 1 replica": ratio(ms["64MiB/push x4"], ms["64MiB/push x1"]),
        "64MiB: shm / stream, 4 replicas": ratio(ms["64MiB/shm x4"], ms["64MiB/push x4"]),
        "64MiB: shm to 4 replicas / memcpy": ratio(ms["64MiB/shm x4"], ms["64MiB/memcpy"]),
        "64MiB: push to 1 replica / memcpy": ratio(ms["64MiB/push x1"], ms["64MiB/memcpy"]),
        "64MiB: push to 4 replicas / memcpy": ratio(ms["64MiB/push x4"], ms["64MiB/memcpy"]),
        "64MiB: trainer encode+serialize / memcpy": ratio(ms["64MiB/encode"], ms["64MiB/memcpy"]),
        "tiny: 4 replicas / 1 replica": ratio(ms["tiny/push x4"], ms["tiny/push x1"]),
        "tiny shm: 4 replicas / 1 replica": ratio(ms["tiny/shm x4"], ms["tiny/shm x1"]),
        "tiny: push to 1 replica (ms)": ms["tiny/push x1"],
    }


NOTES = [
    "push xN = GrpcWeightTransport.push to N replica processes in parallel: encode once "
    "(one copy, one xxh3/crc32 checksum), serialize once, stream; each replica writes chunks "
    "into one buffer, verifies, loads (HFEngine.load_weights from zero-copy views), flushes.",
    "shm xN = the same, but encoded once into a /dev/shm file and each replica sent only the "
    "header naming it; each maps the file copy-on-write, verifies, loads, flushes.",
    "encode = the trainer's once-per-push share of that (weights.encode + PreparedUpdate.of).",
    "memcpy = numpy copy of the same number of bytes into a warm buffer, same run.",
    "x_memcpy = p50 / memcpy p50 of the same model. Before this change a push of the tiny model "
    "to one replica took 26.8 ms p50 (sha256 three times, ~10 copies; results of 3b8e4c6).",
    "All replica processes share the machine's cores with the trainer side: on a 2-core machine "
    "4 replicas cannot receive, verify and load in parallel with each other.",
]


def measure_delta(model: Path, dtype: str, lr: float = 1e-6) -> dict[str, Any]:
    """Full push vs delta for one real AdamW step (LM loss on random tokens, ``lr``): bytes,
    tensors changed, the trainer's and one in-process replica's seconds, and what XOR of the
    old and new bytes plus zlib would have sent. No replica processes: the wire is not timed
    (a gRPC stream costs about a memcpy per MiB, so bytes are the wire's share)."""
    import torch

    from rlfleet.model.model_io import load_causal_lm
    from rlfleet.model.optim import adamw

    torch.manual_seed(0)
    net = load_causal_lm(str(model), dtype)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimizer = adamw(list(net.parameters()), lr=lr, weight_decay=0.0)
    ids = torch.randint(0, net.config.vocab_size, (4, 64))
    net(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    after = {n: p.detach() for n, p in net.named_parameters()}
    return asyncio.run(_delta_rows(model, dtype, before, after))


async def _delta_rows(model: Path, dtype: str, before: dict, after: dict) -> dict[str, Any]:
    import zlib

    import numpy

    from rlfleet.trainer.weight_transport import GrpcWeightTransport

    transport = GrpcWeightTransport(lambda a: None, lambda h, p, c: None, CHUNK_BYTES)
    transport.delta = "always"
    full1 = transport._encode(before, 1, True, False, False)
    transport._plan_delta(before, full1, 1, False)
    started = time.perf_counter()
    full2 = transport._encode(after, 2, True, False, False)
    encode_s = time.perf_counter() - started
    delta = transport._plan_delta(after, full2, 2, False)
    plan_s = time.perf_counter() - started - encode_s
    changed = delta.encoded.header.tensors[1:] if delta else full2.header.tensors
    old = numpy.frombuffer(full1.payload, numpy.uint8)
    xor = numpy.bitwise_xor(old, numpy.frombuffer(full2.payload, numpy.uint8))
    started = time.perf_counter()
    packed = len(zlib.compress(xor.tobytes(), 1))
    xor_s = time.perf_counter() - started
    replica = await _replica_seconds(model, dtype, full1, full2, delta)
    return {
        "model": model.name,
        "dtype": dtype,
        "tensors": len(full2.header.tensors),
        "tensors_changed": len(changed),
        "full_MiB": full2.header.total_bytes / 2**20,
        "delta_MiB": (delta.encoded.header.total_bytes / 2**20) if delta else None,
        "bytes_changed_fraction": float(numpy.count_nonzero(xor)) / len(xor),
        "xor_zlib1_MiB": packed / 2**20,
        "xor_zlib1_s": xor_s,
        "trainer_encode_full_s": encode_s,
        "trainer_delta_plan_s": plan_s,
        **replica,
        "note": "delta is None: every tensor changed, the transport sends the full push"
        if delta is None
        else "",
    }


async def _replica_seconds(model: Path, dtype: str, full1, full2, delta) -> dict[str, float]:
    """One in-process replica (``WeightUpdater`` over an HF engine): verify+load seconds of
    the full push, and of the delta when there is one."""
    from rlfleet.common.config import load_config
    from rlfleet.rollout.engines.hf import HFEngine
    from rlfleet.rollout.weight_updates import WeightUpdater, verified

    config = load_config(
        overrides=[
            f"model.path={model}",
            f"model.dtype={dtype}",
            "rollout.backend=hf",
            "trainer.weight_delta=always",
        ]
    )
    engine = HFEngine(config)
    await engine.start()
    try:
        updater = WeightUpdater(config, engine, lambda _: None)
        out = {}
        for label, encoded in (("full", full1), ("full", full2), ("delta", delta)):
            if encoded is None:
                continue
            encoded = getattr(encoded, "encoded", encoded)
            if label == "delta":  # back to v1 so the delta's base is served
                updater.version = 0
                await updater.load(full1.header, verified(full1.header, full1.payload))
            header = replace(encoded.header, force=label == "full")
            started = time.perf_counter()
            updater.check(header)
            await updater.load(header, verified(header, encoded.payload))
            out[f"replica_{label}_s"] = time.perf_counter() - started
        return out
    finally:
        await engine.close()


def _delta_main(argv: list[str]) -> int:
    """``python bench/bench_weights.py --delta [--lr 1e-6] [--smollm2-only]``: the delta rows
    as JSON lines (SmolLM2 rows when ``make smollm2`` has built it)."""
    import json

    from rlfleet.model.local_models import SMOLLM2, is_built, model_dir

    lr = float(argv[argv.index("--lr") + 1]) if "--lr" in argv else 1e-6
    cases = [] if "--smollm2-only" in argv else [(MODEL_DIR, "float32"), (MODEL_DIR, "bfloat16")]
    if is_built(model_dir(SMOLLM2)):  # float32: the shipped recipe's dtype
        cases += [(model_dir(SMOLLM2), "float32"), (model_dir(SMOLLM2), "bfloat16")]
    for model, dtype in cases:
        print(json.dumps({"lr": lr, **measure_delta(Path(model), dtype, lr)}), flush=True)
    return 0


if __name__ == "__main__" and "--delta" in sys.argv:
    sys.exit(_delta_main(sys.argv[1:]))

if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
