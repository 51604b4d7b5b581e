"""Weight sync: the codec alone against a full push to a real rollout replica process.

Why: after every training step the trainer pushes the new weights to every replica. A push is
encode (flatten + sha256) → gRPC client stream in chunks → decode (checksum + rebuild) →
drain → load into the engine → flush. Timing the codec alone next to the whole push, in the
same run, says how much of a push is the codec and how much is transport, draining and loading.

The replica is a real ``python -m rlfleet.rollout.main`` process (hf backend, an embedded
Redis started here); it is stopped with SIGTERM (then SIGKILL) whatever happens. The codec's
raw speed is also measured on a larger synthetic state dict, where fixed costs stop mattering.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import MODEL_DIR, REPO, BenchResult, Options, Stats, abba, progress, ratio, timed

NAME = "weights"
TITLE = "Weight codec vs a full push to a rollout replica"
VARIANTS = ("codec", "push")
START_TIMEOUT_S = 180.0


def run(options: Options) -> BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    options.work_dir.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis(options.work_dir / "weights-redis") as server:
        replica = _start_replica(server.url, options)
        try:
            samples = asyncio.run(_measure(replica, options))
        finally:
            _stop(replica.proc)
    synthetic = _synthetic(options)
    samples["synthetic"] = _codec_samples(synthetic, options.pick(full=5, quick=2))
    samples["sha256"] = _sha256_samples(synthetic, options.pick(full=5, quick=2))
    return _result(samples, options)


class Replica:
    """The replica process we started, where it listens, and where its log goes."""

    def __init__(self, proc: subprocess.Popen, address: str, log_path: Path) -> None:
        self.proc, self.address, self.log_path = proc, address, log_path


def _start_replica(redis_url: str, options: Options) -> Replica:
    from rlfleet.common.redis_server import free_port

    port, log_path = free_port(), options.work_dir / "replica.log"
    command = [sys.executable, "-m", "rlfleet.rollout.main", "--replica-id", "bench-weights",
               "--port", str(port), f"redis_url={redis_url}", "cluster=bench",
               "rollout.backend=hf", f"model.path={MODEL_DIR}", f"model.dtype={options.dtype}",
               f"rollout.torch_threads={options.hf_threads}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    progress(f"weights: replica pid {proc.pid} starting on port {port} (log {log_path})")
    return Replica(proc, f"127.0.0.1:{port}", log_path)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM our replica, SIGKILL it if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    progress(f"weights: replica pid {proc.pid} stopped (exit {proc.returncode})")


async def _measure(replica: Replica, options: Options) -> dict[str, list[Any]]:
    from rlfleet.rollout.client import RolloutClient

    state_dict = _tiny_state_dict(options.dtype)
    async with RolloutClient(replica.address) as client:
        await _wait_serving(client, replica)
        samples: dict[str, list[Any]] = {variant: [] for variant in VARIANTS}
        rounds = options.pick(full=20, quick=4)
        version = 0
        for index, variant in abba(VARIANTS, rounds + 1):  # round 0 is a warm-up
            if variant == "codec":
                sample = await asyncio.to_thread(_codec_once, state_dict)
            else:
                version += 1
                sample = await _push_once(client, state_dict, version)
            if index:
                samples[variant].append(sample)
        progress(f"weights: {rounds} codec runs and {rounds} pushes done (version {version})")
    return samples


async def _wait_serving(client: Any, replica: Replica) -> None:
    """Until the replica's engine is loaded (state ``serving``); fail fast if it died."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            tail = replica.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"replica exited with {replica.proc.returncode}:\n{tail}")
        try:
            if (await client.status())["state"] == "serving":
                progress("weights: replica serving")
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.25)
    raise TimeoutError(f"replica not serving within {START_TIMEOUT_S:.0f}s")


def _tiny_state_dict(dtype: str) -> dict[str, Any]:
    import safetensors.torch
    import torch

    loaded = safetensors.torch.load_file(str(MODEL_DIR / "model.safetensors"))
    return {name: tensor.to(getattr(torch, dtype)) for name, tensor in loaded.items()}


def _synthetic(options: Options) -> dict[str, Any]:
    """Random float32 tensors totalling 64 MiB (16 MiB with --quick), 4 MiB each."""
    import torch

    count = options.pick(full=16, quick=4)
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(1024, 1024, generator=generator) for i in range(count)}


def _codec_once(state_dict: dict[str, Any]) -> dict[str, float]:
    from rlfleet.common import weights

    start = time.perf_counter()
    header, payload = weights.encode(state_dict, version=1)
    middle = time.perf_counter()
    weights.decode(header, payload)
    end = time.perf_counter()
    return {"seconds": end - start, "encode_s": middle - start, "decode_s": end - middle,
            "bytes": header.total_bytes}  # fmt: skip


def _codec_samples(state_dict: dict[str, Any], rounds: int) -> list[dict[str, float]]:
    progress(f"weights: codec on a synthetic {_mib(state_dict):.0f} MiB state dict")
    _codec_once(state_dict)  # warm-up
    return [_codec_once(state_dict) for _ in range(rounds)]


def _sha256_samples(state_dict: dict[str, Any], rounds: int) -> list[dict[str, float]]:
    """The checksum alone on the same payload: the part of the codec that is pure hashing."""
    from rlfleet.common import weights

    _, payload = weights.encode(state_dict, version=1)
    samples = []
    for _ in range(rounds):
        seconds, _ = timed(lambda: weights.sha256_hex(payload))
        samples.append({"seconds": seconds, "bytes": len(payload)})
    return samples


async def _push_once(client: Any, state_dict: dict[str, Any], version: int) -> dict[str, float]:
    """Encode here, stream, and wait for the replica to verify, load and flush."""
    from rlfleet.common import weights

    start = time.perf_counter()
    header, payload = await asyncio.to_thread(weights.encode, state_dict, version)
    reply = await client.push_weights(header, payload)
    if reply.version != version:
        raise RuntimeError(f"replica answered version {reply.version}, pushed {version}")
    return {"seconds": time.perf_counter() - start, "load_s": reply.load_seconds,
            "bytes": header.total_bytes}  # fmt: skip


def _mib(state_dict: dict[str, Any]) -> float:
    return sum(t.numel() * t.element_size() for t in state_dict.values()) / 2**20


def _row(variant: str, samples: list[dict[str, float]]) -> dict[str, Any]:
    seconds = Stats.of([s["seconds"] for s in samples])
    mib = samples[0]["bytes"] / 2**20
    row = {"variant": variant, "n": seconds.n, "MiB": mib, "p50_ms": seconds.p50 * 1e3,
           "p90_ms": seconds.p90 * 1e3, "MiB_per_s": mib / seconds.p50}  # fmt: skip
    for part in ("encode_s", "decode_s", "load_s"):
        if part in samples[0]:
            row[part.replace("_s", "_p50_ms")] = Stats.of([s[part] for s in samples]).p50 * 1e3
    return row


def _result(samples: dict[str, list[dict[str, float]]], options: Options) -> BenchResult:
    names = {"codec": "codec (tiny model)", "push": "push to replica (tiny model)",
             "synthetic": "codec (synthetic)", "sha256": "sha256 only (synthetic)"}  # fmt: skip
    rows = {key: _row(names[key], values) for key, values in samples.items()}
    return BenchResult(
        name=NAME, title=TITLE, rows=list(rows.values()), ratios=_ratios(rows), notes=NOTES,
        columns=["variant", "n", "MiB", "p50_ms", "p90_ms", "MiB_per_s", "encode_p50_ms",
                 "decode_p50_ms", "load_p50_ms"],
        params={"dtype": options.dtype, "backend": "hf", "chunk_MiB": 4, "transport": "gRPC"},
    )  # fmt: skip


def _ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    push, codec = rows["push"]["p50_ms"], rows["codec"]["p50_ms"]
    return {
        "push/codec time (p50)": ratio(push, codec),
        "replica load+flush share of push": ratio(rows["push"]["load_p50_ms"], push),
        "sha256 (both ends) share of codec": ratio(
            2 * rows["sha256"]["p50_ms"], rows["synthetic"]["p50_ms"]
        ),
    }


NOTES = [
    "codec = weights.encode + weights.decode (sha256 both ways); push = encode + "
    "RolloutClient.push_weights to a separate replica process, which decodes, drains, loads "
    "(HFEngine.load_weights) and flushes before answering.",
    "load = the replica's own load_seconds (engine load + flush).",
]


if __name__ == "__main__":
    import run_all

    sys.exit(run_all.main(["--only", NAME, *sys.argv[1:]]))
