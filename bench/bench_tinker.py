"""The Tinker API through the official SDK vs the same work without HTTP.

Why: the API (docs/tinker.md) puts an HTTP hop, the SDK's futures (submit, then poll
``retrieve_future``) and a wire conversion in front of the trainer's adapter code. This
measures what that costs, on the tiny policy with one HF replica (``rlfleet up --config
configs/tinker.yaml``), in one run with the variants interleaved in ABBA order:

- **training**: ``forward_backward`` (cross-entropy) + ``optim_step`` pairs per second, the
  cookbook's way (submit both, then wait for both), with 1 and 4 training clients at once, each
  its own adapter. ``api``: the SDK's ``TrainingClient`` against the fleet's trainer.
  ``in-process``: the same calls on the API's core (``TinkerService``: the same checks,
  futures, per-client order, compute thread and ``AdapterPool``) in this process, no HTTP, no
  wire conversion. Both load the same model with one torch thread.
- **sampling**: tokens/s of 16 prompts x 8 samples at once (the shape of
  ``examples/tinker/rl_loop.py``'s step). ``api``: ``SamplingClient.sample`` on an adapter's
  snapshot (pushed to the replica once, at warm-up). ``router``: the same requests as one
  ``GenerateBatch`` to the fleet's router (what the API's sampler sends).

Usage: ``python bench/bench_tinker.py [--quick]`` (or ``run_all.py --only tinker``); writes
``bench/results/tinker.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
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
)

NAME = "tinker"
TITLE = "Tinker API through the SDK vs in process: training pairs/s, sampling tokens/s"
KEY = "tml-bench-tinker"
CONFIG = REPO / "configs" / "tinker.yaml"
TRAIN_DATA = REPO / "data" / "arith" / "train.jsonl"
ADAPTERS = (1, 4)
VARIANTS = ("api", "in-process")
BATCHES = (1, 64)
"""Datums per ``forward_backward``: one (the fixed cost per call) and 64 (work to amortize it)."""
RANK, LR = 16, 1e-4
PROMPTS, SAMPLES, MAX_TOKENS = 16, 8, 8
START_TIMEOUT_S = 240.0


def run(options: Options) -> BenchResult:
    import tinker

    work = options.work_dir / NAME
    with fleet(work) as (url, router, metrics, up_pid):
        cpu = Cpu(up_pid)
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        caps = tinker.RestClient(base_url=url, api_key=KEY).get_server_capabilities().result()
        base_model = caps.supported_models[0].model_name
        core = Core(_core_config(work, router))
        try:
            train = _training(options, service, core, base_model, cpu)
            sample = _sampling(options, service, router, metrics, base_model, cpu)
            trip = _round_trip(url, options.pick(200, 50))
            transport = _sdk_transport(url)
        finally:
            core.close()
            service.close("success").result()
    return _result(options, train, sample, trip, transport)


# ---- the fleet and the in-process core ---------------------------------------------------


@contextmanager
def fleet(work: Path) -> Iterator[tuple[str, str, str, int]]:
    """``rlfleet up`` on configs/tinker.yaml with one HF replica: (API URL, router address,
    router's ``/metrics`` URL, the ``rlfleet up`` process's PID)."""
    run_dir = work / "run"
    argv = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "up",
        "--config",
        str(CONFIG),
        "--rollout-replicas",
        "1",
        *_overrides(run_dir),
    ]
    env = {k: v for k, v in os.environ.items() if k != "RLFLEET_REDIS_URL"}
    work.mkdir(parents=True, exist_ok=True)
    with (work / "up.log").open("wb") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = _wait_api(proc, run_dir, work / "up.log")
            router = json.loads((run_dir / "endpoints.json").read_text())["router"]
            progress(f"{NAME}: fleet up, API at {url}")
            yield url, router["grpc"], router["http"].removesuffix("/v1") + "/metrics", proc.pid
        finally:
            stop_child(proc, group=True)


def _overrides(run_dir: Path) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "cluster=benchtinker",
        "rollout.backend=hf",
        "dashboard.enabled=false",
        f"api_key={KEY}",
        "tinker.max_adapters=16",
        "trainer.replica_wait_s=240",
    ]


def _wait_api(proc: subprocess.Popen, run_dir: Path, log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"rlfleet up exited with {proc.returncode}:\n{log.read_text()[-2000:]}"
            )
        try:
            url = json.loads((run_dir / "endpoints.json").read_text())["tinker"]["http"]
            with urllib.request.urlopen(url + "/api/v1/healthz", timeout=2) as reply:
                if reply.status == 200:
                    return url
        except (OSError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Tinker API did not answer within {START_TIMEOUT_S:.0f}s")


def _core_config(work: Path, router: str) -> Any:
    from rlfleet.common.config import load_config

    overrides = [*_overrides(work / "in-process"), f"endpoints.router={router}"]
    return load_config(CONFIG, overrides=overrides, env={})


class Core:
    """The API's core (``TinkerService``) on an event loop of its own, in this process."""

    def __init__(self, config: Any) -> None:
        from rlfleet.trainer.tinker.serve import build_service

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.service = self.call(build_service(config))
        self.session = self.call(_async(self.service.create_session))
        self.seq: dict[str, int] = {}

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def create(self, base_model: str, model_seq: int) -> str:
        from rlfleet.trainer.tinker.types import LoraSpec

        spec = LoraSpec(rank=RANK, seed=0, train_unembed=False)
        rid = self.call(
            _async(self.service.create_model, self.session, model_seq, base_model, spec)
        )
        model_id = self.call(self._result(rid))
        self.seq[model_id] = 1
        return model_id

    def pairs(self, model_ids: list[str], data: list, count: int) -> None:
        """``count`` forward_backward + optim_step pairs on each model, the models at once."""
        self.call(self._pairs(model_ids, data, count))

    async def _pairs(self, model_ids: list[str], data: list, count: int) -> None:
        from rlfleet.trainer.tinker.types import AdamStep

        async def one(model_id: str) -> None:
            for _ in range(count):
                seq = self.seq[model_id]
                self.seq[model_id] = seq + 2
                fb = self.service.forward_backward(model_id, seq, data, "cross_entropy", {}, False)
                step = self.service.optim_step(model_id, seq + 1, AdamStep(learning_rate=LR))
                await self._result(fb)
                await self._result(step)

        await asyncio.gather(*(one(m) for m in model_ids))

    async def _result(self, request_id: str) -> Any:
        from rlfleet.trainer.tinker.futures import Done

        outcome = await self.service.futures.retrieve(request_id, wait_s=600)
        if not isinstance(outcome, Done):
            raise RuntimeError(f"in-process call {request_id}: {outcome}")
        return outcome.value

    def close(self) -> None:
        self.call(self.service.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _async(fn: Callable, *args: Any) -> Any:
    return fn(*args)


class Cpu:
    """CPU seconds (user + system) used so far by this process (the SDK's threads, the
    in-process core) and by the fleet's (``rlfleet up`` and every role under it).

    Why: on a shared 2-core machine the wall time of a round moves with other people's load;
    the CPU a round burns does much less, and it says where the API's extra time comes from
    (the SDK's client, the server's HTTP handling) when the cores are the bottleneck."""

    def __init__(self, up_pid: int) -> None:
        import psutil

        self.procs = [psutil.Process(), *psutil.Process(up_pid).children(recursive=True)]

    def seconds(self) -> tuple[float, float]:
        """(this process's, every process's) CPU seconds so far."""
        import psutil

        each = []
        for proc in self.procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:  # a role that exited: its time is gone from both sides
                continue
            each.append(times.user + times.system)
        return each[0], sum(each)

    def measure(self, fn: Callable[[], Any]) -> tuple[Any, float, tuple[float, float]]:
        """``fn()``'s result, wall seconds and (this process's, every process's) CPU seconds."""
        (here, total), start = self.seconds(), time.perf_counter()
        value = fn()
        seconds = time.perf_counter() - start
        here_after, total_after = self.seconds()
        return value, seconds, (here_after - here, total_after - total)


# ---- training ------------------------------------------------------------------------------


def _training(options: Options, service: Any, core: Core, base_model: str, cpu: Cpu) -> dict:
    """(batch, adapters, variant) -> [(pairs per second, CPU ms per pair of this process and
    of all) of each round]."""
    clients = [
        service.create_lora_training_client(
            base_model=base_model, rank=RANK, seed=0, train_unembed=False
        ).result()
        for _ in range(max(ADAPTERS))
    ]
    models = [core.create(base_model, i) for i in range(max(ADAPTERS))]
    tokenizer = clients[0].get_tokenizer()
    rounds, count = options.pick(4, 2), options.pick(3, 2)
    rates: dict[tuple[int, int, str], list[tuple[float, float, float]]] = {}
    for batch in BATCHES:
        sdk_data, core_data = _data(tokenizer, batch)
        for adapters in ADAPTERS:
            runs = {
                "api": lambda n=adapters, d=sdk_data: _api_pairs(clients[:n], d, count),
                "in-process": lambda n=adapters, d=core_data: core.pairs(models[:n], d, count),
            }
            for fn in runs.values():  # warm-up: first calls, allocator, the optimizers' state
                fn()
            for _, variant in abba(list(runs), rounds):
                _, seconds, (here, used) = cpu.measure(runs[variant])
                pairs = adapters * count
                rates.setdefault((batch, adapters, variant), []).append(
                    (pairs / seconds, 1e3 * here / pairs, 1e3 * used / pairs)
                )
            progress(f"{NAME}: training batch {batch}, {adapters} adapter(s) done")
    return rates


def _api_pairs(clients: list, data: list, count: int) -> None:
    import tinker

    adam = tinker.types.AdamParams(learning_rate=LR)

    def one(client: Any) -> None:
        for _ in range(count):
            fb = client.forward_backward(data, "cross_entropy")
            step = client.optim_step(adam)
            fb.result(), step.result()

    with ThreadPoolExecutor(len(clients)) as pool:
        list(pool.map(one, clients))


def _data(tokenizer: Any, batch: int) -> tuple[list, list]:
    """``batch`` arithmetic question+answer sequences, loss on the answer: as SDK datums and
    as the core's own records (the same tokens and weights)."""
    import numpy as np
    from tinker import types

    from rlfleet.trainer.tinker.types import Datum

    rows = [json.loads(line) for line in TRAIN_DATA.read_text().splitlines()[:batch]]
    sdk, core = [], []
    for row in rows:
        prompt = tokenizer.encode(row["prompt"][-1]["content"])
        answer = tokenizer.encode(row["reward_model"]["ground_truth"], add_special_tokens=False)
        tokens = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        inputs = {"target_tokens": tokens[1:], "weights": weights}
        sdk.append(
            types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)
        )
        arrays = {
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": np.asarray(weights, dtype=np.float32),
        }
        core.append(Datum(tokens[:-1], arrays))
    return sdk, core


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- sampling ------------------------------------------------------------------------------


def _sampling(
    options: Options, service: Any, router: str, metrics: str, base_model: str, cpu: Cpu
) -> dict:
    """``tokens``: variant -> [(tokens, seconds, (CPU seconds here, in all)) of each round];
    ``router_calls``:
    "variant API" -> [the router's calls of that API during each round]."""
    from tinker import types

    trainer = service.create_lora_training_client(
        base_model=base_model, rank=RANK, seed=0, train_unembed=False
    ).result()
    tokenizer = trainer.get_tokenizer()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    rows = [json.loads(line) for line in TRAIN_DATA.read_text().splitlines()[:PROMPTS]]
    prompts = [tokenizer.encode(r["prompt"][-1]["content"]) for r in rows]
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)

    def api() -> int:
        futures = [sampler.sample(types.ModelInput.from_ints(p), SAMPLES, params) for p in prompts]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    direct = Direct(router, prompts)
    try:
        runs = {"api": api, "router": direct.generate, "router-calls": direct.generate_each}
        for fn in runs.values():  # warm-up (the API's first sample pushes the snapshot)
            fn()
        samples: dict[str, list[tuple[int, float, tuple[float, float]]]] = {}
        calls: dict[str, list[float]] = {}
        for _, variant in abba(list(runs), options.pick(6, 3)):
            before = router_calls(metrics)
            tokens, seconds, used = cpu.measure(runs[variant])
            samples.setdefault(variant, []).append((tokens, seconds, used))
            after = router_calls(metrics)
            for api, count in after.items():
                calls.setdefault(f"{variant} {api}", []).append(count - before.get(api, 0.0))
        progress(f"{NAME}: sampling done")
        return {"tokens": samples, "router_calls": calls}
    finally:
        direct.close()


class Direct:
    """The same requests straight to the router: one ``GenerateBatch``."""

    def __init__(self, router: str, prompts: list[list[int]]) -> None:
        from rlfleet.rollout.client import RolloutClient

        self.prompts, self.loop = prompts, asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(_async(RolloutClient, router, KEY))

    def generate(self) -> int:
        """One ``GenerateBatch`` of every prompt (what the API's sampler sends at best)."""
        results = self.loop.run_until_complete(self.client.generate_batch(self._requests()))
        return sum(len(c.token_ids) for r in results for c in r.completions)

    def generate_each(self) -> int:
        """One ``Generate`` per prompt, all at once (no batching on the caller's side)."""

        async def each() -> list:
            return await asyncio.gather(*(self.client.generate(r) for r in self._requests()))

        results = self.loop.run_until_complete(each())
        return sum(len(c.token_ids) for r in results for c in r.completions)

    def _requests(self) -> list:
        import uuid

        from rlfleet.rollout.types import GenerateRequest, SamplingParams

        sampling = SamplingParams(
            n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, logprobs=1, top_k=0
        )
        return [
            GenerateRequest(
                request_id=f"bench-{uuid.uuid4().hex}",
                sampling=sampling,
                prompt_token_ids=list(p),
                session_id=f"bench-{i}",
                timeout_s=300,
            )
            for i, p in enumerate(self.prompts)
        ]

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def router_calls(metrics_url: str) -> dict[str, float]:
    """Calls the router has answered so far, by API (``GenerateBatch``, ``Generate``, ...)."""
    import re

    request = urllib.request.Request(metrics_url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        text = reply.read().decode()
    pattern = r'^rlfleet_router_request_seconds_count\{api="([^"]+)"\} (\S+)$'
    return {api: float(n) for api, n in re.findall(pattern, text, flags=re.M)}


def _round_trip(url: str, count: int) -> float:
    """Median seconds of one plain HTTP request to the API (``healthz``, keep-alive)."""
    import httpx

    with httpx.Client(base_url=url) as client:
        client.get("/api/v1/healthz")
        return Stats.of([_seconds(lambda: client.get("/api/v1/healthz")) for _ in range(count)]).p50


def _sdk_transport(url: str) -> str:
    """The HTTP transport the server's client config gives the SDK: pyqwest or httpx."""
    import httpx

    config = httpx.post(f"{url}/api/v1/client/config", headers={"X-API-Key": KEY}).json()
    return "pyqwest" if config.get("use_pyqwest_transport", True) else "httpx"


# ---- the result ----------------------------------------------------------------------------


def _result(
    options: Options, train: dict, sample: dict, trip: float, transport: str
) -> BenchResult:
    rows, ratios = [], {}
    for (batch, adapters, variant), rounds in train.items():
        stats = Stats.of([rate for rate, _, _ in rounds])
        rows.append(
            {
                "work": f"train batch {batch}",
                "adapters": adapters,
                "variant": variant,
                "n": stats.n,
                "median": stats.p50,
                "unit": "pairs/s",
                "ms_per_pair": 1e3 / stats.p50,
                "cpu_ms": Stats.of([used for _, _, used in rounds]).p50,
                "cpu_ms_here": Stats.of([here for _, here, _ in rounds]).p50,
            }
        )
    median = {(r["work"], r["adapters"], r["variant"]): r for r in rows}
    for batch in BATCHES:
        for adapters in ADAPTERS:
            api, core = (median[(f"train batch {batch}", adapters, v)] for v in VARIANTS)
            name = f"batch {batch}, {adapters} adapter(s): api"
            ratios[f"{name} time / in-process"] = ratio(core["median"], api["median"])
            ratios[f"{name} CPU / in-process"] = ratio(api["cpu_ms"], core["cpu_ms"])
    tokens_per_s, cpu_per_round = {}, {}
    for variant, rounds in sample["tokens"].items():
        stats = Stats.of([tokens / seconds for tokens, seconds, _ in rounds])
        tokens_per_s[variant] = stats.p50
        cpu_per_round[variant] = Stats.of([1e3 * cpu[1] for _, _, cpu in rounds]).p50
        rows.append(
            {
                "work": f"sample {PROMPTS}x{SAMPLES}",
                "adapters": 1,
                "variant": variant,
                "n": stats.n,
                "median": stats.p50,
                "unit": "tokens/s",
                "ms_per_pair": float("nan"),
                "cpu_ms": cpu_per_round[variant],
                "cpu_ms_here": Stats.of([1e3 * cpu[0] for _, _, cpu in rounds]).p50,
            }
        )
    ratios["sampling: router tokens/s / api tokens/s"] = ratio(
        tokens_per_s["router"], tokens_per_s["api"]
    )
    ratios["sampling: router one call per prompt / api tokens/s"] = ratio(
        tokens_per_s["router-calls"], tokens_per_s["api"]
    )
    ratios["sampling: api CPU / router CPU per round"] = ratio(
        cpu_per_round["api"], cpu_per_round["router"]
    )
    return BenchResult(
        name=NAME,
        title=TITLE,
        columns=[
            "work",
            "adapters",
            "variant",
            "n",
            "median",
            "unit",
            "ms_per_pair",
            "cpu_ms",
            "cpu_ms_here",
        ],
        rows=rows,
        ratios=ratios,
        params={
            "quick": options.quick,
            "batches": list(BATCHES),
            "adapters": list(ADAPTERS),
            "rank": RANK,
            "loss": "cross_entropy",
            "sampling": f"{PROMPTS} prompts x {SAMPLES} samples, max_tokens {MAX_TOKENS}, T=1",
            "http_round_trip_ms": round(trip * 1e3, 2),
            "sdk_http_transport": transport,
            "router_calls_per_sampling_round": {
                key: sum(counts) / len(counts) for key, counts in sample["router_calls"].items()
            },
        },
        notes=_notes(),
    )


def _notes() -> list[str]:
    return [
        "A training round: every adapter runs its pairs (forward_backward then optim_step, "
        "both submitted, then both awaited), the adapters at once; rate = pairs / seconds.",
        "api time / in-process: how much longer a pair takes through the API (1.10 = 10% more).",
        "cpu_ms: CPU milliseconds (user + system) of this process (the SDK's client, the "
        "in-process core) and of every fleet process together, per pair (training) or per "
        "round (sampling); cpu_ms_here: this process's part (for api rows the SDK's client, "
        "for in-process rows the core itself); api CPU / in-process: how much more CPU a pair "
        "costs through the API, which on a loaded 2-core machine turns into wall time.",
        "Both variants run on one torch thread each on the same 2-core machine; the fleet's "
        "replica, router and Redis idle during training rounds.",
    ]


def main(argv: list[str] | None = None) -> int:
    import common

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    options = Options(quick=args.quick)
    options.work_dir.mkdir(parents=True, exist_ok=True)
    start, before = time.monotonic(), common.load_avg()
    machine = common.machine_info()
    result = run(options)
    result.seconds = time.monotonic() - start
    result.load_avg = {"before": before, "after": common.load_avg()}
    path = common.write_result(result, machine, args.out)
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
