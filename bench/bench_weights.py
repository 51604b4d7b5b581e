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


def _start_replica(
    redis_url: str, model: Path, replica_id: str, options: Options, *extra: str
) -> Replica:
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
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    progress(f"weights: replica {replica_id} pid {proc.pid} starting on port {port}")
    return Replica(proc, f"127.0.0.1:{port}", log_path)


async def _measure(replicas: list[Replica], model: Path, options: Options) -> dict[str, list]:
    from rlfleet.rollout.client import PreparedUpdate, RolloutClient
    from rlfleet.trainer.weight_broadcast import BroadcastWeightTransport
    from rlfleet.trainer.weight_transport import GrpcWeightTransport

    state_dict = _state_dict(model, options.dtype)
    transports = {
        "push": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES),
        "shm": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, True),
        "broadcast": BroadcastWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, 60),
    }
    clients = [RolloutClient(r.address) for r in replicas]
    try:
        targets = [await _wait_serving(c, r) for c, r in zip(clients, replicas, strict=True)]
        pushes = [f"{kind} x{n}" for kind in transports for n in FANOUTS]
        variants = ["memcpy", "encode", *pushes]

        async def once(variant: str, version: int) -> dict[str, float]:
            return await _once(variant, state_dict, transports, targets, version)

        return await rounds(variants, options.pick(full=10, quick=3), once)
    finally:
        await close_all([*transports.values(), *clients])


async def rounds(variants, count: int, once, version: int = 0) -> dict[str, list]:
    """``count`` samples of each variant (``await once(variant, version)``) in ABBA order after
    a warm-up round, each call with the next version (every replica sees versions only go up)."""
    samples: dict[str, list] = {v: [] for v in variants}
    for index, variant in abba(variants, count + 1):
        version += 1
        sample = await once(variant, version)
        if index:  # round 0 is a warm-up
            samples[variant].append(sample)
    return samples


async def close_all(closables) -> None:
    """Close transports and clients, in order."""
    for closable in closables:
        await closable.close()


async def _once(variant, state_dict, transports, targets, version: int) -> dict[str, float]:
    if variant == "memcpy":
        return await asyncio.to_thread(_memcpy_once, state_dict)
    if variant == "encode":
        return await asyncio.to_thread(_encode_once, state_dict)
    kind, fanout = variant.split(" x")
    transport, fanout = transports[kind], int(fanout)
    first = await _new_group(transport, state_dict, version, targets[:fanout])
    start = time.perf_counter()
    results = await transport.push(state_dict, version, True, targets[:fanout], bool(first))
    seconds = time.perf_counter() - start
    if not all(r.ok and r.version == version for r in results):
        raise RuntimeError(f"push of v{version} failed: {[r.error for r in results]}")
    if getattr(results[0], "broadcast", "member") != "member":
        raise RuntimeError(f"broadcast push of v{version}: {[r.broadcast for r in results]}")
    return {
        **first,
        "seconds": seconds,
        "bytes": results[0].bytes,
        "slowest_replica_s": max(r.seconds for r in results),
        "pause_s_max": max(r.pause_s for r in results),
    }


async def _new_group(transport, state_dict, version: int, targets) -> dict[str, float]:
    """A broadcast to other members than its open group's opens a new one (a store, every
    member joining): that first push is timed apart (``first_push_s``), and the push measured
    is the next, on the open group (forced: the same version again)."""
    members = tuple(t.replica_id for t in targets)
    if getattr(transport, "group_members", members) == members:
        return {}
    start = time.perf_counter()
    await transport.push(state_dict, version, True, targets)
    return {"first_push_s": time.perf_counter() - start}


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
    firsts = [s["first_push_s"] for s in samples if "first_push_s" in s]
    if firsts:  # broadcast: the pushes that opened its group (not every sample: ABBA's turn)
        row["first_push_p50_ms"] = Stats.of(firsts).p50 * 1e3
    if "pause_s_max" in samples[0]:  # the longest replica pause of each push (its reply)
        row["pause_max_p50_ms"] = Stats.of([s["pause_s_max"] for s in samples]).p50 * 1e3
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
            "pause_max_p50_ms",
            "first_push_p50_ms",
        ],
        params={
            "dtype": options.dtype,
            "backend": "hf",
            "chunk_MiB": CHUNK_BYTES // 2**20,
            "transport": "GrpcWeightTransport: gRPC stream (push), /dev/shm (shm); "
            "BroadcastWeightTransport: gloo broadcast (broadcast)",
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
        "64MiB: broadcast / stream, 4 replicas": ratio(
            ms["64MiB/broadcast x4"], ms["64MiB/push x4"]
        ),
        "64MiB: broadcast / shm, 4 replicas": ratio(ms["64MiB/broadcast x4"], ms["64MiB/shm x4"]),
        "64MiB broadcast: 4 replicas / 1 replica": ratio(
            ms["64MiB/broadcast x4"], ms["64MiB/broadcast x1"]
        ),
    }


NOTES = [
    "push xN = GrpcWeightTransport.push to N replica processes in parallel: encode once "
    "(one copy, one xxh3/crc32 checksum), serialize once, stream; each replica writes chunks "
    "into one buffer, verifies, loads (HFEngine.load_weights from zero-copy views), flushes.",
    "pause_max_p50_ms = the longest replica pause of a push (admission closed for the swap and "
    "the flush; UpdateWeightsResponse.pause_seconds), p50 over the pushes.",
    "shm xN = the same, but encoded once into a /dev/shm file and each replica sent only the "
    "header naming it; each maps the file copy-on-write, verifies, loads, flushes.",
    "broadcast xN = BroadcastWeightTransport.push: the header over gRPC, the payload in one "
    "gloo broadcast from the trainer (rank 0) on loopback, on a group already open for these "
    "N members (the same version pushed again, forced); first_push_p50_ms = the push before "
    "it, which opened that group (a new TCP store, every member joining).",
    "encode = the trainer's once-per-push share of that (weights.encode + PreparedUpdate.of).",
    "memcpy = numpy copy of the same number of bytes into a warm buffer, same run.",
    "x_memcpy = p50 / memcpy p50 of the same model. Before this change a push of the tiny model "
    "to one replica took 26.8 ms p50 (sha256 three times, ~10 copies; results of 3b8e4c6).",
    "All replica processes share the machine's cores with the trainer side: on a 2-core machine "
    "4 replicas cannot receive, verify and load in parallel with each other.",
]


DELTA_ROUNDS = 3
DELTA_VARIANTS = ("element delta", "full shm", "full stream")


def measure_delta(model: Path, lr: float = 1e-6, steps: int = 2) -> list[dict[str, Any]]:
    """Element-level delta against the full push, over the last of ``steps`` real AdamW steps
    (LM loss on random tokens, ``lr``), for an fp32 actor pushed in fp32, the same actor pushed
    in bf16 (``rollout.dtype: bfloat16``: only elements whose bf16 rounding moved differ) and a
    bf16 actor. Per case: bytes and codec seconds in-process (index + value against XOR of the
    raw bytes + zstd), and end-to-end pushes to one real replica process (``_push_times``)."""
    from rlfleet.trainer.pushes import cast_weights

    before, after = _stepped(model, "float32", lr, steps)
    rows = [_delta_case(model, "float32", "float32", before, after, lr)]
    before, after = cast_weights(before, "bfloat16"), cast_weights(after, "bfloat16")
    rows.append(_delta_case(model, "float32 pushed as bfloat16", "bfloat16", before, after, lr))
    before, after = _stepped(model, "bfloat16", lr, steps)
    rows.append(_delta_case(model, "bfloat16", "bfloat16", before, after, lr))
    return rows


def _stepped(model: Path, dtype: str, lr: float, steps: int) -> tuple[dict, dict]:
    """The weights before and after the last of ``steps`` AdamW steps."""
    import torch

    from rlfleet.model.model_io import load_causal_lm
    from rlfleet.model.optim import adamw

    torch.manual_seed(0)
    net = load_causal_lm(str(model), dtype)
    optimizer = adamw(list(net.parameters()), lr=lr, weight_decay=0.0)
    before: dict = {}
    for _ in range(steps):
        before = {n: p.detach().clone() for n, p in net.named_parameters()}
        ids = torch.randint(0, net.config.vocab_size, (4, 64))
        optimizer.zero_grad()
        net(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return before, {n: p.detach().clone() for n, p in net.named_parameters()}


def _delta_case(model: Path, label: str, served: str, before, after, lr: float) -> dict:
    progress(f"weights --delta: {model.name} {label}")
    codec = _codec_row(before, after)
    pushes = asyncio.run(_push_times(model, served, before, after))
    row = {"model": model.name, "case": label, "lr": lr, **codec, **pushes}
    row["delta_push_vs_full_shm"] = ratio(row["element delta_s"], row["full shm_s"])
    row["delta_push_vs_full_stream"] = ratio(row["element delta_s"], row["full stream_s"])
    row["xor_zstd_push_s_estimate"] = (
        row["element delta_s"]
        - codec["index_value_plan_s"]
        - codec["index_value_apply_s"]
        + codec["xor_zstd_encode_s"]
        + codec["xor_zstd_apply_s"]
    )
    return row


def _codec_row(before: dict, after: dict) -> dict[str, Any]:
    """In-process, one push: bytes and seconds of index + value (``weights_delta_plan`` and
    ``weights_delta.apply``) against XOR of the raw bytes + zstd level 1 (one thread)."""
    import numpy
    import zstandard

    from rlfleet.model import weights, weights_checksum, weights_delta
    from rlfleet.model.weights_delta_plan import DeltaPlanner

    old_header, old_payload = weights.encode(before, 1)
    (header, payload), encode_s = _timed_value(lambda: weights.encode(after, 2))
    planner = DeltaPlanner()
    planner.plan(old_header, old_payload)
    plan, plan_s = _timed_value(lambda: planner.plan(header, payload))
    (delta_header, delta_payload), delta_encode_s = _timed_value(
        lambda: weights.encode(plan.state, 2)
    )
    base = weights.decode(old_header, bytearray(old_payload))  # apply writes into it
    decoded = weights.decode(delta_header, delta_payload)
    _, apply_s = _timed_value(lambda: weights_delta.apply(decoded, base))
    old = numpy.frombuffer(old_payload, numpy.uint8)
    new = numpy.frombuffer(payload, numpy.uint8)
    compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    packed, xor_s = _timed_value(lambda: compressor.compress(numpy.bitwise_xor(old, new)))

    def unxor() -> None:  # what a replica would do: undo, then the full checksum's pass
        xor = numpy.frombuffer(decompressor.decompress(packed), numpy.uint8)
        weights_checksum.checksum(numpy.bitwise_xor(old, xor))

    _, unxor_s = _timed_value(unxor)
    elements = sum(t.numel() for t in after.values())
    return {
        "full_MiB": header.total_bytes / 2**20,
        "elements_changed_fraction": _changed_elements(old_header, old, new) / elements,
        "delta_ratio": plan.ratio,
        "index_value_MiB": delta_header.total_bytes / 2**20,
        "index_value_zstd1_MiB": len(compressor.compress(delta_payload)) / 2**20,
        "xor_zstd1_MiB": len(packed) / 2**20,
        "trainer_encode_full_s": encode_s,
        "index_value_plan_s": plan_s + delta_encode_s,
        "index_value_apply_s": apply_s,
        "xor_zstd_encode_s": xor_s,
        "xor_zstd_apply_s": unxor_s,
    }


def _timed_value(fn) -> tuple[Any, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def _changed_elements(header, old, new) -> int:
    import numpy

    ints = {1: numpy.int8, 2: numpy.int16, 4: numpy.int32, 8: numpy.int64}
    count = 0
    for entry in header.tensors:
        span = slice(entry.offset, entry.offset + entry.nbytes)
        width = ints[entry.nbytes // max(1, _numel(entry.shape))]
        count += int(numpy.count_nonzero(old[span].view(width) != new[span].view(width)))
    return count


def _numel(shape: tuple[int, ...]) -> int:
    import math

    return math.prod(shape)


async def _push_times(model: Path, served: str, before: dict, after: dict) -> dict[str, float]:
    """End-to-end seconds (encode + send + verify/assemble + load + flush: the trainer's
    ``GrpcWeightTransport.push`` until the replica's reply) of pushing ``after`` to one real
    replica process (hf, ``model.dtype=served``, keeping its base) that serves ``before``: as an
    element delta (its full encoding included, as the transport always makes it), as a full
    push through ``/dev/shm`` (the default on one host) and streamed (other hosts). Median of
    ``DELTA_ROUNDS``, interleaved."""
    from rlfleet.common.redis_server import EmbeddedRedis
    from rlfleet.rollout.client import PreparedUpdate, RolloutClient
    from rlfleet.trainer.weight_transport import GrpcWeightTransport

    work = Options().work_dir / "delta"
    work.mkdir(parents=True, exist_ok=True)
    options = Options(dtype=served, work_dir=work)
    transports = {
        "element delta": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, True),
        "full shm": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, True),
        "full stream": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES),
    }
    transports["element delta"].delta = "always"
    with EmbeddedRedis(work / "redis") as server:
        replica = _start_replica(
            server.url, model, f"delta-{served}", options, "trainer.weight_delta=always"
        )
        client = RolloutClient(replica.address)
        try:
            await _wait_serving(client, replica)
            return await _push_rounds(transports, client, before, after)
        finally:
            for transport in transports.values():
                await transport.close()
            await client.close()
            stop_child(replica.proc, grace_s=15)


async def _push_rounds(transports, client, before: dict, after: dict) -> dict[str, float]:
    seconds: dict[str, list[float]] = {v: [] for v in DELTA_VARIANTS}
    pauses: dict[str, list[float]] = {v: [] for v in DELTA_VARIANTS}
    version = (await client.status()).weight_version
    for _, variant in abba(DELTA_VARIANTS, DELTA_ROUNDS):
        transport = transports[variant]
        if variant == "element delta":  # its base first: the replica serves ``before``
            version += 1
            await transport.push(before, version, True, [await client.status()])
        version += 1
        started = time.perf_counter()
        [result] = await transport.push(after, version, True, [await client.status()])
        seconds[variant].append(time.perf_counter() - started)
        pauses[variant].append(result.pause_s)
        if not result.ok or result.delta != (variant == "element delta"):
            raise RuntimeError(f"{variant} push of v{version}: {result}")
    times = {f"{v}_s": Stats.of(s).p50 for v, s in seconds.items()}
    return times | {f"{v}_pause_s": Stats.of(s).p50 for v, s in pauses.items()}


def _delta_main(argv: list[str]) -> int:
    """``python bench/bench_weights.py --delta [--lr 1e-6] [--steps 2]``: the SmolLM2 delta
    rows as JSON lines (``make smollm2`` builds it), also written to
    ``results/weights_delta.json``."""
    import json

    from rlfleet.model.local_models import SMOLLM2, is_built, model_dir

    lr = float(argv[argv.index("--lr") + 1]) if "--lr" in argv else 1e-6
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 2
    model = MODEL_DIR if "--tiny" in argv else model_dir(SMOLLM2)  # --tiny: a smoke run
    if model != MODEL_DIR and not is_built(model):
        print("SmolLM2 is not built (make smollm2)", file=sys.stderr)
        return 1
    rows = []
    for row in measure_delta(model, lr, steps):
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = REPO / "bench" / "results" / f"weights_delta{'_tiny' if '--tiny' in argv else ''}.json"
    out.write_text(json.dumps({"steps": steps, "rows": rows, "notes": DELTA_NOTES}, indent=1))
    return 0


DELTA_NOTES = [
    "elements_changed_fraction: elements whose raw bits in the pushed dtype changed in the last "
    "step. delta_ratio: element delta payload (index int32 + value, or whole tensors where "
    "that is smaller; metadata included) over the full payload.",
    "element delta_s / full shm_s / full stream_s: end to end, GrpcWeightTransport.push to one "
    "real hf replica process until its reply (trainer encode, plan, send, replica check, "
    "assemble, full checksum, engine load, cache flush), median of 3 rounds, interleaved.",
    "<variant>_pause_s: the replica's pause for that push (admission closed: make way, swap, "
    "cache flush; decode, verify, delta assembly and staging ran before it, while serving), as "
    "its UpdateWeights reply reports it, median of the same rounds.",
    "xor_zstd_push_s_estimate: the element delta push with its codec seconds (plan+encode on "
    "the trainer, assemble on the replica) swapped for XOR + zstd-1 (one thread) compress and "
    "decompress + XOR + checksum; not built into the transport.",
    "Run with nice -n 19 beside another long measurement on a 2-core machine: read ratios "
    "within one run, not absolute seconds.",
]


if __name__ == "__main__" and "--delta" in sys.argv:
    sys.exit(_delta_main(sys.argv[1:]))

if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
