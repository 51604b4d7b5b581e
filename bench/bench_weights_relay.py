"""Weight push streamed by the trainer to every replica vs relayed replica to replica
(``trainer.weight_transport: relay``), to 2 and 4 real replicas on loopback, as a multiple of
one ``socket.sendall`` of the same bytes over loopback TCP.

Why: a streamed push sends the model over the trainer's link once per replica; a relay tree
of fanout k sends it k times and lets the replicas forward it, each chunk as it arrives. What
it buys depends on where the limit is: across machines the trainer's NIC, here on one host
the CPU (every hop still receives, copies and verifies the whole model). So the ratios read:
relay / stream (what the tree costs or saves end to end on this host), and each push /
sendall (the raw transfer of the bytes once, the floor for one link).

Variants, interleaved (ABBA), same replicas, same run: ``sendall`` (a thread reading into a
warm buffer what one ``sendall`` writes), ``shm xN`` (``GrpcWeightTransport`` through one
``/dev/shm`` file: today's ``auto`` on the trainer's host, the bar a relay must beat to become
``auto`` there), ``stream xN`` (without shared memory), ``relay kK xN`` (``RelayWeightTransport`` of fanout K: k1 is a chain, k2 two roots).
Models: the tiny policy, and SmolLM2-135M in bf16 when ``make smollm2`` has built it. Replicas
are ``python -m rlfleet.rollout.main`` (hf), started and stopped here.

``python bench/bench_weights_relay.py [--quick]`` (or ``run_all.py --only weights_relay``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path
from typing import Any

from bench_weights import _row as weights_row
from bench_weights import _start_replica, _state_dict, _wait_serving, close_all, rounds
from common import MODEL_DIR, BenchResult, Options, progress, ratio, stop_child

NAME = "weights_relay"
TITLE = "Weight push streamed vs relayed replica to replica, to 2 and 4 replicas, vs sendall"
CHUNK_BYTES = 4 * 2**20
VARIANTS = (
    "sendall",
    "shm x2",
    "stream x2",
    "relay k1 x2",
    "shm x4",
    "stream x4",
    "relay k1 x4",
    "relay k2 x4",
)


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    options.work_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    with EmbeddedRedis(options.work_dir / "relay-redis") as server:
        for label, path, dtype in _models(options):
            rows.update(_measure_model(label, path, dtype, server.url, options))
    return _result(rows, options)


def _models(options: Options) -> list[tuple[str, Path, str]]:
    from rlfleet.model.local_models import SMOLLM2, is_built, model_dir

    models = [("tiny", MODEL_DIR, options.dtype)]
    if is_built(model_dir(SMOLLM2)):
        models.append(("smollm2-bf16", model_dir(SMOLLM2), "bfloat16"))
    else:
        progress("weights_relay: SmolLM2 not built (make smollm2): tiny model only")
    return models


def _measure_model(label: str, path: Path, dtype: str, redis_url: str, options: Options) -> dict:
    run_options = Options(options.quick, dtype, options.hf_threads, work_dir=options.work_dir)
    replicas = [_start_replica(redis_url, path, f"{label}-{i}", run_options) for i in range(4)]
    try:
        samples = asyncio.run(_measure(replicas, path, dtype, options))
    finally:
        for replica in replicas:
            stop_child(replica.proc, grace_s=15)
    return {f"{label}/{v}": _row(label, v, s) for v, s in samples.items()}


async def _measure(replicas, model: Path, dtype: str, options: Options) -> dict[str, list]:
    from rlfleet.rollout.client import PreparedUpdate, RolloutClient
    from rlfleet.trainer.weight_relay import RelayWeightTransport
    from rlfleet.trainer.weight_transport import GrpcWeightTransport

    state_dict = _state_dict(model, dtype)
    transports = {
        "shm": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, True),
        "stream": GrpcWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES),
        "relay k1": RelayWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, 1),
        "relay k2": RelayWeightTransport(RolloutClient, PreparedUpdate.of, CHUNK_BYTES, 2),
    }
    clients = [RolloutClient(r.address) for r in replicas]
    try:
        targets = [await _wait_serving(c, r) for c, r in zip(clients, replicas, strict=True)]

        async def once(variant: str, version: int) -> dict[str, float]:
            if variant == "sendall":
                return await asyncio.to_thread(_sendall_once, state_dict)
            return await _push_once(variant, state_dict, transports, targets, version)

        start = max(t.weight_version for t in targets)
        return await rounds(VARIANTS, options.pick(full=6, quick=2), once, start)
    finally:
        await close_all([*transports.values(), *clients])


async def _push_once(variant, state_dict, transports, targets, version: int) -> dict[str, float]:
    kind, fanout = variant.rsplit(" x", 1)
    start = time.perf_counter()
    results = await transports[kind].push(state_dict, version, True, targets[: int(fanout)])
    seconds = time.perf_counter() - start
    if not all(r.ok and r.version == version for r in results):
        raise RuntimeError(f"{variant} push of v{version} failed: {[r.error for r in results]}")
    from rlfleet.trainer.weight_relay import RelayedResult

    how = [r.relay if isinstance(r, RelayedResult) else "root" for r in results]
    if "fallback" in how:
        raise RuntimeError(f"{variant} push of v{version}: relay fallbacks {how}")
    from_trainer = sum(r.bytes for r, came in zip(results, how, strict=True) if came != "parent")
    if kind == "shm":  # written once into the file the replicas map
        from_trainer = results[0].bytes
    return {"seconds": seconds, "bytes": results[0].bytes, "trainer_bytes": from_trainer}


def _sendall_once(state_dict: dict[str, Any]) -> dict[str, float]:
    """One ``sendall`` of as many bytes as the payload over loopback TCP, until a thread has
    read them all into a warm buffer."""
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    payload, sink = bytearray(b"\x01" * nbytes), bytearray(nbytes)
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def receive() -> None:
        connection, _ = listener.accept()
        view, got = memoryview(sink), 0
        with connection:
            while got < nbytes:
                got += connection.recv_into(view[got:])
        done.set()

    reader = threading.Thread(target=receive, daemon=True)
    reader.start()
    with socket.create_connection(listener.getsockname()) as sender:
        start = time.perf_counter()
        sender.sendall(payload)
        done.wait(120)
        seconds = time.perf_counter() - start
    reader.join(5)
    listener.close()
    return {"seconds": seconds, "bytes": nbytes, "trainer_bytes": nbytes}


def _row(model: str, variant: str, samples: list[dict[str, float]]) -> dict[str, Any]:
    """``bench_weights``' row (p50, p90, MiB/s), plus the bytes the trainer itself sent."""
    return {
        **weights_row(model, variant, samples),
        "trainer_MiB": samples[0]["trainer_bytes"] / 2**20,
    }


def _result(rows: dict[str, dict[str, Any]], options: Options) -> BenchResult:
    ms = {key: row["p50_ms"] for key, row in rows.items()}
    ratios: dict[str, float] = {}
    for key, row in rows.items():
        model = key.split("/")[0]
        row["x_sendall"] = ratio(row["p50_ms"], ms[f"{model}/sendall"])
    for model in sorted({key.split("/")[0] for key in rows}):
        for n in (2, 4):
            ratios[f"{model}: relay k1 / stream, {n} replicas"] = ratio(
                ms[f"{model}/relay k1 x{n}"], ms[f"{model}/stream x{n}"]
            )
        ratios[f"{model}: relay k2 / stream, 4 replicas"] = ratio(
            ms[f"{model}/relay k2 x4"], ms[f"{model}/stream x4"]
        )
        ratios[f"{model}: best relay / shm, 4 replicas"] = ratio(
            min(ms[f"{model}/relay k1 x4"], ms[f"{model}/relay k2 x4"]), ms[f"{model}/shm x4"]
        )
        for variant in ("shm x4", "stream x4", "relay k1 x4", "relay k2 x4"):
            ratios[f"{model}: {variant} / sendall"] = rows[f"{model}/{variant}"]["x_sendall"]
    columns = ["model", "variant", "n", "MiB", "p50_ms", "p90_ms", "x_sendall", "MiB_per_s"]
    columns.append("trainer_MiB")
    params = {"chunk_MiB": CHUNK_BYTES // 2**20, "backend": "hf", "quick": options.quick}
    return BenchResult(NAME, TITLE, columns, list(rows.values()), ratios, params, NOTES)


NOTES = [
    "stream xN = GrpcWeightTransport.push (no shared memory) to N replica processes at once: "
    "the trainer streams the whole payload to each. relay kK xN = RelayWeightTransport.push: "
    "the trainer streams to K replicas, each forwards every chunk as it arrives to up to K "
    "others (k1: a chain; k2 x4: two roots with one child each). End to end: encode, send, "
    "forward, every replica's checksum, load and flush, until the last answer.",
    "shm xN = the same through one /dev/shm file the replicas map (the header alone is sent).",
    "trainer_MiB = bytes the trainer itself sent (the model once per replica it streamed to; "
    "for shm, once into the file).",
    "sendall = one socket.sendall of the payload's size over loopback TCP into a reading "
    "thread (the raw transfer of the model once over one link); x_sendall = p50 / its p50.",
    "One 2-core host: every hop's receive, forward and verify share the same two cores, so "
    "the relay cannot show here what it saves on a trainer's NIC across machines.",
]


if __name__ == "__main__":
    import sys

    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
