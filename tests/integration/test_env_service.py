"""The env role as real processes: ``rlfleet env`` (front door + worker-only processes) on a real
Redis, a real router and two hf replicas of the default job's tiny model, called through
``EnvClient``.

The environment is written here (``ENV_MODULE``, importable by the workers through
``PYTHONPATH``): the user asks ``1+1=``, the environment answers ``2+2=`` after the first turn
and ends after the second. The tokenizer is the default job's with a small chat template
(``<bos>`` opens a user turn, ``<eos>`` ends an assistant one), so the episodes are in the
policy's own alphabet. Checked: every episode answered once, two turns each, the arrays
consistent and the environment's tokens exactly the template's, every turn of an episode on
one replica (the episode id is the session), versions recorded; a failing environment is a
counted failed episode; bad requests are INVALID_ARGUMENT naming the field; and a worker
SIGKILLed mid-batch costs exactly its episodes a restart each, nothing lost or answered twice.
One fleet per file; every process is stopped by its own PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis
from procs import ServiceProcess, clean_env
from replica_proc import MODEL
from router_fleet import Fleet, add_replica, launch_fleet, teardown

from rlfleet.agent.episode import EndReason
from rlfleet.common.endpoints import read_endpoints
from rlfleet.common.errors import InvalidArgument
from rlfleet.common.grpc_client import make_channel
from rlfleet.common.keys import ENV_GROUP
from rlfleet.common.redis_server import EmbeddedRedis, free_port
from rlfleet.common.trajectory import NO_VERSION
from rlfleet.env.client import EnvClient
from rlfleet.env.types import EpisodeJob, EpisodeResult
from rlfleet.proto import common_pb2, env_pb2, env_pb2_grpc
from rlfleet.rollout.types import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]

TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ m.content }}<eos>"
    "{%- else %}<bos>{{ m.content }}{%- endif %}{%- endfor %}"
)
ENV_MODULE = '''
import asyncio


class TwoTurnEnv:
    """Answers 2+2= after the first turn, ends after the second; extra_info.fail raises."""

    def __init__(self, turns=2, delay_s=0.0):
        self.turns, self.delay_s, self.steps = turns, delay_s, 0

    async def reset(self, **task):
        if (task.get("extra_info") or {}).get("fail"):
            raise RuntimeError("asked to fail")
        return list(task["prompt"])

    async def step(self, message):
        self.steps += 1
        await asyncio.sleep(self.delay_s)
        if self.steps >= self.turns:
            return [], 1.0, True, {"reward_parts": {"done": 1.0}}
        return [{"role": "user", "content": "2+2="}], 0.0, False, {}
'''
PROMPT_IDS = [1, 5, 14, 5, 15]  # <bos> 1 + 1 =
OBSERVATION_IDS = [1, 6, 14, 6, 15]  # <bos> 2 + 2 =
EOS = 2
SAMPLING = SamplingParams(temperature=1.0, max_tokens=4)


@dataclass
class EnvFleet:
    """Router + replicas, the env front door and its worker-only processes."""

    fleet: Fleet
    address: str
    args: list[str]
    env: dict[str, str]
    run_dir: Path
    front: ServiceProcess | None = None
    workers: list[ServiceProcess] = field(default_factory=list)

    def start_worker(self) -> ServiceProcess:
        log_path = self.run_dir / f"env-worker-{len(self.workers)}.log"
        argv = [*self.args, "agent.workers=1", "agent.concurrency=4", "--worker-only"]
        worker = ServiceProcess.start(argv, log_path, "env worker", env=self.env)
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        for process in [*self.workers, *([self.front] if self.front else [])]:
            process.stop(signal.SIGKILL)


def chat_model(where: Path) -> Path:
    """The default job's model folder with a chat template added to its tokenizer."""
    target = where / "tiny-chat"
    shutil.copytree(MODEL, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return target


def env_processes(fleet: Fleet, run_dir: Path) -> EnvFleet:
    """The command line every env process of this file shares, and its environment."""
    (run_dir / "two_turn_env.py").write_text(ENV_MODULE)
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "rlfleet.env.main",
        f"redis_url={fleet.redis_url}",
        f"cluster={fleet.keys.cluster}",
        f"endpoints.router={fleet.address}",
        f"model.path={chat_model(run_dir)}",
        "agent.env=two_turn_env:TwoTurnEnv",
        "agent.env_kwargs={delay_s: 0.1}",
        "agent.max_episode_tokens=64",
        "agent.reclaim_idle_s=1.0",
        f"agent.port={port}",
    ]
    env = clean_env(RLFLEET_RUN_DIR=str(run_dir), PYTHONPATH=str(run_dir))
    return EnvFleet(fleet, f"127.0.0.1:{port}", args, env, run_dir)


@pytest.fixture(scope="module")
def env_fleet(redis_server: EmbeddedRedis, tmp_path_factory) -> Iterator[EnvFleet]:
    """Two replicas, a front door without workers of its own, and two worker-only processes
    (started before the replicas, so their tokenizers load while the replicas start)."""
    run_dir = tmp_path_factory.mktemp("env_fleet")
    fleet = launch_fleet(redis_server, run_dir)
    try:
        envs = env_processes(fleet, run_dir)
        try:
            yield start_env_fleet(envs)
        finally:
            envs.stop()
    finally:
        teardown(fleet)


def start_env_fleet(envs: EnvFleet) -> EnvFleet:
    front_args = [*envs.args, "agent.workers=0"]
    envs.front = ServiceProcess.start(
        front_args, envs.run_dir / "env-front.log", "env front", env=envs.env
    )
    starting = [envs.start_worker(), envs.start_worker()]
    add_replica(envs.fleet, "ra")
    add_replica(envs.fleet, "rb")
    for worker in starting:
        worker.wait_for_line("started on", 120)
    envs.front.wait_healthy(envs.address, "rlfleet.v1.Env", 60)
    return envs


@pytest.fixture
async def client(env_fleet: EnvFleet):
    async with EnvClient(env_fleet.address, timeout_s=120) as env_client:
        await env_client.wait_ready(10)
        yield env_client


def jobs(n: int, prefix: str = "", **extra) -> list[EpisodeJob]:
    prefix = prefix or uuid.uuid4().hex[:6]
    task = {"prompt": [{"role": "user", "content": "1+1="}], "data_source": "two_turn", **extra}
    return [EpisodeJob(f"{prefix}-{i}", task, group_id=f"{prefix}-g{i // 4}") for i in range(n)]


def check_episode(result: EpisodeResult) -> None:
    """Two turns; sampled, then exactly the template's tokens, then sampled; one replica."""
    episode = result.episode
    assert not result.failed and result.error == "", result.error
    assert (episode.num_turns, episode.end_reason, episode.reward) == (2, EndReason.DONE, 1.0)
    assert episode.reward_parts == {"done": 1.0} and episode.prompt_ids == PROMPT_IDS
    n = len(episode.response_ids)
    assert n == len(episode.response_mask) == len(episode.response_logprobs)
    assert n == len(episode.response_versions) and episode.total_tokens <= 64
    first = episode.response_mask.index(0)
    second = episode.response_mask.index(1, first)
    between = episode.response_ids[first:second]
    closing = [] if episode.response_ids[first - 1] == EOS else [EOS]
    assert between == closing + OBSERVATION_IDS and all(episode.response_mask[second:])
    for mask, logprob, version in zip(
        episode.response_mask, episode.response_logprobs, episode.response_versions, strict=True
    ):
        assert (logprob <= 0.0 and version == 0) if mask else (logprob, version) == (0, NO_VERSION)
    assert len(result.replica_ids) == 2 and len(set(result.replica_ids)) == 1
    assert result.replica_ids[0] in {"ra", "rb"}
    roles = [m["role"] for m in episode.messages]
    assert roles == ["user", "assistant", "user", "assistant"]


async def test_a_batch_plays_every_episode_once_on_sticky_sessions(client):
    batch = jobs(16)
    results = await client.run_episodes(batch, SAMPLING, max_turns=4)
    assert [r.episode_id for r in results] == [job.episode_id for job in batch]
    assert [r.episode.episode_id for r in results] == [job.episode_id for job in batch]
    for result in results:
        check_episode(result)
    assert all(r.restarts == 0 for r in results)


async def test_a_failing_environment_is_a_counted_failed_episode(client, env_fleet):
    results = await client.run_episodes([*jobs(2, extra_info={"fail": True}), *jobs(2)], SAMPLING)
    assert [r.failed for r in results] == [True, True, False, False]
    assert all("asked to fail" in r.error and r.episode.failed for r in results[:2])
    for result in results[2:]:
        check_episode(result)
    assert all(worker.poll() is None for worker in env_fleet.workers)


async def test_bad_requests_are_refused_naming_the_field(env_fleet, client):
    channel = make_channel(env_fleet.address, retry=False)
    stub = env_pb2_grpc.EnvStub(channel)
    bad = [
        (env_pb2.RunEpisodesRequest(jobs=[{"episode_id": ""}]), "jobs[0].episode_id"),
        (
            env_pb2.RunEpisodesRequest(jobs=[{"episode_id": "a"}, {"episode_id": "a"}]),
            "jobs[1].episode_id",
        ),
        (
            env_pb2.RunEpisodesRequest(
                jobs=[{"episode_id": "a"}], sampling={"n": 2, "max_tokens": 4}
            ),
            "sampling.n",
        ),
        (env_pb2.RunEpisodesRequest(jobs=[{"episode_id": "a"}], max_turns=-1), "max_turns"),
    ]
    try:
        for request, name in bad:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RunEpisodes(request)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert name in refused.value.details()
        listed = await stub.ListEnvironments(common_pb2.Empty())
    finally:
        await channel.close()
    active = [(e.name, e.kind) for e in listed.environments if e.active]
    assert active == [("two_turn_env:TwoTurnEnv", "import")]
    assert "calc" in {e.name for e in listed.environments}
    with pytest.raises(InvalidArgument, match=r"jobs\[0\]\.task"):
        await client.run_episodes([EpisodeJob("x", {"bad": {1}})])  # checked before sending
    assert await client.run_episodes([]) == []
    check_episode((await client.run_episodes(jobs(1), SAMPLING))[0])


def test_the_front_door_is_in_endpoints_json(env_fleet):
    entry = read_endpoints(env_fleet.run_dir)["env"]
    assert entry["grpc"] == env_fleet.address and entry["redis"].startswith("redis://")


async def test_a_worker_killed_mid_batch_costs_its_episodes_one_restart_each(client, env_fleet):
    """One of the two workers is SIGKILLed holding episodes; the other restarts them. A
    replacement is started afterwards (not waited for), so the fleet keeps two workers."""
    victim = env_fleet.workers[1]
    batch = jobs(16)
    running = asyncio.create_task(client.run_episodes(batch, SAMPLING))
    held = await asyncio.to_thread(freeze_when_busy, env_fleet, victim)
    assert held, "the victim held no episode when it was frozen"
    victim.kill()
    env_fleet.start_worker()
    results = await running
    assert [r.episode_id for r in results] == [job.episode_id for job in batch]
    for result in results:
        check_episode(result)
    restarted = {r.episode_id: r.restarts for r in results if r.restarts}
    assert restarted == {episode_id: 1 for episode_id in held}
    assert all(worker.poll() is None for worker in env_fleet.workers if worker is not victim)


def freeze_when_busy(env_fleet: EnvFleet, victim: ServiceProcess) -> set[str]:
    """SIGSTOP the victim once it holds episodes; the ids of those it holds (frozen, so the set
    cannot change before the SIGKILL that follows)."""
    client = redis.Redis.from_url(env_fleet.fleet.redis_url)
    try:
        victim.wait_until(lambda: held_by(client, env_fleet, victim.pid), 60, "busy")
        os.kill(victim.pid, signal.SIGSTOP)
        return held_by(client, env_fleet, victim.pid)
    finally:
        client.close()


def held_by(client: redis.Redis, env_fleet: EnvFleet, pid: int) -> set[str]:
    """Episode ids pending on the consumers of process ``pid``."""
    stream = env_fleet.fleet.keys.env_stream
    names = [
        c["name"]
        for c in client.xinfo_consumers(stream, ENV_GROUP)
        if f"-{pid}-env-".encode() in c["name"] and int(c["pending"])
    ]
    entries = [
        p["message_id"]
        for name in names
        for p in client.xpending_range(stream, ENV_GROUP, "-", "+", 100, consumername=name)
    ]
    payloads = [client.xrange(stream, eid, eid) for eid in entries]
    return {json.loads(found[0][1][b"payload"])["job"]["episode_id"] for found in payloads if found}
