"""The refcritic as a real process (``python -m rlfleet.refcritic.main``) on a free port.

Uses the committed tiny model when it exists, else a tiny random Qwen2 saved for the session.
Every process started here is stopped by its PID in a finalizer, even when a test fails.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from procs import ServiceProcess
from redis.exceptions import ResponseError

from rlfleet.common.errors import RlfleetError
from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.model.model_io import load_causal_lm
from rlfleet.refcritic.client import RefCriticClient
from rlfleet.refcritic.queue_service import GROUP, QueuedCompute

ROOT = Path(__file__).resolve().parents[2]
COMMITTED_MODEL = ROOT / "models" / "tiny-qwen2-arith"
SERVICE = "rlfleet.v1.RefCritic"

pytestmark = pytest.mark.slow


@dataclass
class Service:
    address: str
    process: ServiceProcess
    log: Path


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return COMMITTED_MODEL


def start_process(model_dir: Path, log_dir: Path, *args: str) -> Service:
    """``python -m rlfleet.refcritic.main`` with ``args``; does not wait for it to be ready."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "rlfleet.refcritic.main",
        "--port",
        str(port),
        f"model.path={model_dir}",
        "refcritic.micro_batch_size=16",
        *args,
    ]
    log = log_dir / f"refcritic-{port}.log"
    return Service(f"127.0.0.1:{port}", ServiceProcess.start(argv, log, name="refcritic"), log)


def start_service(model_dir: Path, log_dir: Path, *overrides: str) -> Service:
    service = start_process(model_dir, log_dir, *overrides)
    try:
        service.process.wait_healthy(service.address, SERVICE, timeout_s=120)
    except BaseException:
        service.process.stop(signal.SIGKILL)
        raise
    return service


@pytest.fixture(scope="module")
def service(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    started = start_service(model_dir, tmp_path_factory.mktemp("refcritic-logs"))
    try:
        yield started
    finally:
        started.process.stop()


@pytest.fixture
async def client(service: Service) -> Iterator[RefCriticClient]:
    async with RefCriticClient(service.address, timeout_s=60) as c:
        yield c


def random_batch(n: int, prompt_len: int, response_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, 16, (n, prompt_len), generator=gen).tolist()
    lengths = torch.randint(1, response_len + 1, (n,), generator=gen).tolist()
    responses = [torch.randint(4, 16, (k,), generator=gen).tolist() for k in lengths]
    return prompts, responses


def local_logprobs(model_dir: Path, prompts, responses) -> list[list[float]]:
    model = load_causal_lm(model_dir)
    rows = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            logp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0], -1)
            rows.append([logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)])
    return rows


async def test_ref_logprobs_match_the_model_run_locally(client, model_dir: Path):
    prompts, responses = random_batch(128, 7, 4)
    started = time.perf_counter()
    rows = await client.ref_logprobs(prompts, responses)
    print(f"ComputeRefLogProbs 128 x (7 + <=4): {1000 * (time.perf_counter() - started):.1f} ms")
    expected = local_logprobs(model_dir, prompts, responses)
    assert [len(r) for r in rows] == [len(r) for r in responses]
    for got, want in zip(rows, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-4)


async def test_values_have_one_number_per_response_token(client):
    prompts, responses = random_batch(9, 5, 6, seed=1)
    values = await client.values(prompts, responses)
    assert [len(v) for v in values] == [len(r) for r in responses]


async def test_update_critic_reports_metrics_and_moves_values(client):
    prompts, responses = random_batch(8, 5, 3, seed=2)
    old = await client.values(prompts, responses)
    returns = [[1.0] * len(r) for r in responses]
    metrics = await client.update_critic(prompts, responses, returns, old, epochs=2)
    for name in (
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/grad_norm",
        "critic/vpred_mean",
        "critic/lr",
    ):
        assert name in metrics
    assert metrics["critic/vf_loss"] > 0
    assert client.critic_step >= 2
    assert await client.values(prompts, responses) != old


@pytest.mark.parametrize(
    "bad",
    ["empty", "out_of_vocab", "empty_response", "mismatched_returns"],
)
async def test_bad_input_is_invalid_argument_and_service_keeps_serving(client, bad, service):
    prompts, responses = random_batch(3, 4, 2, seed=3)
    zeros = [[0.0] * len(r) for r in responses]
    calls = {
        "empty": lambda: client.ref_logprobs([], []),
        "out_of_vocab": lambda: client.ref_logprobs(prompts, [[999]] + responses[1:]),
        "empty_response": lambda: client.values(prompts, [[]] + responses[1:]),
        "mismatched_returns": lambda: client.update_critic(prompts, responses, zeros[:2], zeros),
    }
    with pytest.raises(RlfleetError) as info:  # its __cause__ is the gRPC error
        await calls[bad]()
    assert info.value.__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(await client.ref_logprobs(prompts, responses)) == 3
    assert service.process.poll() is None


async def test_checkpoint_round_trip(client, tmp_path: Path):
    prompts, responses = random_batch(6, 5, 3, seed=4)
    returns = [[0.5] * len(r) for r in responses]
    await client.update_critic(prompts, responses, returns, await client.values(prompts, responses))
    saved = await client.save_checkpoint(str(tmp_path / "critic"))
    before = await client.values(prompts, responses)
    await client.update_critic(prompts, responses, returns, before)
    assert await client.values(prompts, responses) != before
    loaded = await client.load_checkpoint(saved.path)
    assert loaded.step == saved.step
    assert await client.values(prompts, responses) == before
    with pytest.raises(RlfleetError) as info:  # its __cause__ is the gRPC error
        await client.load_checkpoint(str(tmp_path / "missing"))
    assert info.value.__cause__.code() == grpc.StatusCode.NOT_FOUND


async def test_disabled_critic_and_api_key(model_dir: Path, tmp_path: Path):
    """Critic off -> FAILED_PRECONDITION; with an API key, calls need it; SIGTERM exits 0."""
    service = start_service(model_dir, tmp_path, "refcritic.critic_enabled=false", "api_key=s3cret")
    try:
        prompts, responses = random_batch(2, 3, 2)
        async with RefCriticClient(service.address, api_key="s3cret", timeout_s=60) as good:
            assert len(await good.ref_logprobs(prompts, responses)) == 2
            with pytest.raises(RlfleetError) as info:  # its __cause__ is the gRPC error
                await good.values(prompts, responses)
            assert info.value.__cause__.code() == grpc.StatusCode.FAILED_PRECONDITION
        async with RefCriticClient(service.address, timeout_s=60) as anonymous:
            with pytest.raises(RlfleetError) as info:  # its __cause__ is the gRPC error
                await anonymous.ref_logprobs(prompts, responses)
            assert info.value.__cause__.code() == grpc.StatusCode.UNAUTHENTICATED
        assert service.process.stop() == 0
    finally:
        service.process.stop()


# ---- the queue path (redis_url set) --------------------------------------------------------


@pytest.fixture(scope="module")
def queued_service(
    model_dir: Path, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """A refcritic whose reads go through Redis (db 0, a cluster of its own), 2 workers/kind."""
    started = start_service(
        model_dir,
        tmp_path_factory.mktemp("refcritic-queued-logs"),
        f"redis_url={redis_server.url}",
        f"cluster=q{uuid.uuid4().hex[:10]}",
        "refcritic.workers=2",
    )
    try:
        yield started
    finally:
        started.process.stop()


@pytest.fixture
async def queued_client(queued_service: Service) -> Iterator[RefCriticClient]:
    async with RefCriticClient(queued_service.address, timeout_s=60) as c:
        yield c


async def test_queued_ref_logprobs_match_the_model_run_locally(queued_client, model_dir: Path):
    prompts, responses = random_batch(100, 7, 4, seed=5)
    started = time.perf_counter()
    rows = await queued_client.ref_logprobs(prompts, responses)
    print(
        f"queued ComputeRefLogProbs 100 x (7 + <=4): {1000 * (time.perf_counter() - started):.1f} ms"
    )
    expected = local_logprobs(model_dir, prompts, responses)
    assert [len(r) for r in rows] == [len(r) for r in responses]
    for got, want in zip(rows, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-4)


async def test_queued_values_come_from_the_trained_critic(queued_client):
    """Values are answered by this process's critic, so an update shows in the next read."""
    prompts, responses = random_batch(20, 5, 3, seed=6)
    old = await queued_client.values(prompts, responses)
    assert [len(v) for v in old] == [len(r) for r in responses]
    returns = [[1.0] * len(r) for r in responses]
    await queued_client.update_critic(prompts, responses, returns, old, epochs=2)
    assert await queued_client.values(prompts, responses) != old


async def test_queued_bad_input_is_invalid_argument(queued_client, queued_service: Service):
    prompts, responses = random_batch(3, 4, 2, seed=7)
    with pytest.raises(RlfleetError) as info:  # its __cause__ is the gRPC error
        await queued_client.ref_logprobs(prompts, [[999]] + responses[1:])
    assert info.value.__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(await queued_client.ref_logprobs(prompts, responses)) == 3
    assert queued_service.process.poll() is None


async def entries_added(redis_client, stream: str) -> int:
    try:
        return int((await redis_client.xinfo_stream(stream))["entries-added"])
    except ResponseError:  # no stream: nothing was ever queued
        return 0


@pytest.mark.parametrize("local_first", [True, False])
async def test_reads_skip_redis_while_the_own_worker_is_idle(
    model_dir: Path, redis_url: str, redis_client, keys: Keys, tmp_path: Path, local_first: bool
):
    """Local first: no job at all; queue path: one job for the batch (one idle worker), and a
    bad sequence in it is still INVALID_ARGUMENT, validated once, by the worker's model."""
    service = start_service(
        model_dir,
        tmp_path,
        f"redis_url={redis_url}",
        f"cluster={keys.cluster}",
        f"refcritic.local_first={str(local_first).lower()}",
        "refcritic.critic_enabled=false",
    )
    prompts, responses = random_batch(40, 6, 3, seed=9)
    try:
        async with RefCriticClient(service.address, timeout_s=60) as client:
            rows = await client.ref_logprobs(prompts, responses)
            with pytest.raises(RlfleetError) as info:
                await client.ref_logprobs(prompts, responses[:-1] + [[999]])
    finally:
        service.process.stop()
    assert info.value.__cause__.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 39" in str(info.value)
    assert [len(r) for r in rows] == [len(r) for r in responses]
    assert await entries_added(redis_client, keys.refcritic_stream) == (0 if local_first else 2)


async def wait_held_by(redis_client, keys: Keys, pid: int, timeout_s: float = 120.0) -> None:
    """Until a ref job is pending on a consumer of process ``pid`` (it has taken the job)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pending = await redis_client.xpending_range(keys.refcritic_stream, GROUP, "-", "+", 10)
        except ResponseError:  # group not created yet
            pending = []
        if any(f"-{pid}-" in p["consumer"].decode() for p in pending):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no worker of process {pid} took the job in {timeout_s} s")


async def test_killed_workers_job_is_reclaimed_and_answered(
    model_dir: Path, redis_url: str, redis_client, keys: Keys, tmp_path: Path
):
    """A worker-only process SIGKILLed while holding a job: another worker answers it."""
    common = (f"redis_url={redis_url}", f"cluster={keys.cluster}", "refcritic.reclaim_idle_s=1")
    prompts, responses = random_batch(8, 6, 3, seed=8)
    queue = QueuedCompute(redis_client, keys, chunk_size=16, timeout_s=180)
    await queue.start()
    answer = asyncio.create_task(queue.compute("ref", prompts, responses))
    slow = start_process(
        model_dir, tmp_path, "--worker-only", *common, "refcritic.worker_delay_s=600"
    )
    try:
        await wait_held_by(redis_client, keys, slow.process.pid)
    finally:
        slow.process.stop(signal.SIGKILL)
    assert not answer.done()
    rescuer = start_process(model_dir, tmp_path, "--worker-only", *common)
    try:
        rows = await asyncio.wait_for(answer, 180)
    finally:
        assert rescuer.process.stop() == 0
    for got, want in zip(rows, local_logprobs(model_dir, prompts, responses), strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    assert "reclaimed stalled job" in rescuer.log.read_text()
