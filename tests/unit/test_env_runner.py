"""Env workers without a router: environments that fail are counted failed episodes (never a
dead worker), the environment is resolved from ``agent.env``, and on a real Redis every job is
answered once, in order, with a reclaimed episode's restart counted.

The tokenizer is the default job's, copied with a small chat template (``<bos>`` opens a user
turn, ``<eos>`` ends an assistant turn), so no tool-using model is needed here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import pytest

from rlfleet.agent.env import ToolEnv
from rlfleet.agent.episode import EndReason, Episode
from rlfleet.common.config.agent import AgentConfig
from rlfleet.common.jobs import JobWorkerPool
from rlfleet.common.redis_server import free_port
from rlfleet.env.runner import EpisodeRunner, env_maker, load_renderer
from rlfleet.env.service import EnvService, env_queue
from rlfleet.env.types import EpisodeJob, EpisodeSettings, QueuedEpisode
from rlfleet.env.worker import EnvWorker
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "tiny-qwen2-arith"
TEMPLATE = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{{ m.content }}<eos>"
            "{%- else %}<bos>{{ m.content }}{%- endif %}{%- endfor %}")  # fmt: skip
TASK = {"prompt": [{"role": "user", "content": "1+1="}]}
SETTINGS = EpisodeSettings(SamplingParams(max_tokens=4), max_turns=2, max_episode_tokens=64)

pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no tiny model")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


class RaisingEnv:
    """Its ``reset`` raises: every episode fails before its first turn."""

    def reset(self, **task):
        raise RuntimeError("no such task")

    def step(self, message):
        raise AssertionError("never reached")


class SlowEnv:
    """Takes ``delay_s`` to reset, then never ends."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    async def reset(self, **task):
        await asyncio.sleep(self.delay_s)
        return [{"role": "user", "content": "1+1="}]

    async def step(self, message):
        return [{"role": "user", "content": "1+1="}], 0.0, False, {}


class ToolUser(ToolEnv):
    """A ToolEnv built the way ``agent.env`` + ``agent.tools`` build one."""

    def __init__(self, tools, bonus: float = 0.0) -> None:
        super().__init__(tools, lambda text, truth: bonus)


def chat_model(where: Path) -> Path:
    """The default job's model folder with a chat template added to its tokenizer."""
    target = where / "tiny-chat"
    shutil.copytree(MODEL, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return target


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    return load_renderer(str(chat_model(tmp_path_factory.mktemp("model"))))


@pytest.fixture
async def nowhere():
    """A router address nobody listens on."""
    client = RolloutClient(f"127.0.0.1:{free_port()}")
    yield client
    await client.close()


def agent(**fields) -> AgentConfig:
    limits = {"tool_timeout_s": 0.2, "step_timeout_s": 2.0, "episode_timeout_s": 5.0}
    return AgentConfig(**{"env": "tests:Env", **limits, **fields})


def queued(episode_id: str = "e0") -> QueuedEpisode:
    return QueuedEpisode(EpisodeJob(episode_id, TASK), SETTINGS)


async def test_an_environment_that_raises_is_a_failed_episode(renderer, nowhere):
    runner = EpisodeRunner(RaisingEnv, renderer, nowhere, agent())
    outcome = await runner.play(queued(), restarts=1)
    episode = Episode.decode(outcome.episode)
    assert episode.end_reason == EndReason.ERROR and "no such task" in outcome.error
    assert (outcome.restarts, outcome.replica_ids, runner.failed) == (1, [], 1)


async def test_an_environment_that_cannot_be_built_is_a_failed_episode(renderer, nowhere):
    def broken():
        raise ValueError("missing credentials")

    outcome = await EpisodeRunner(broken, renderer, nowhere, agent()).play(queued())
    assert outcome.error == "ValueError: missing credentials"
    assert Episode.decode(outcome.episode).failed


async def test_an_episode_past_its_time_limit_is_a_failed_episode(renderer, nowhere):
    """Building the environment and its reset each fit the step limit; together they do not
    fit the episode's."""

    def slow_to_build():
        time.sleep(0.25)
        return SlowEnv(0.25)

    limits = agent(step_timeout_s=0.4, episode_timeout_s=0.4)
    outcome = await EpisodeRunner(slow_to_build, renderer, nowhere, limits).play(queued())
    assert outcome.error == "episode timed out after 0.4s"
    assert Episode.decode(outcome.episode).failed


async def test_an_unreachable_router_is_a_failed_episode(renderer, nowhere):
    outcome = await EpisodeRunner(SlowEnv, renderer, nowhere, agent()).play(queued())
    assert "Unavailable" in outcome.error and Episode.decode(outcome.episode).failed


def test_the_environment_is_resolved_from_agent_env():
    calc = env_maker(AgentConfig(env="calc", tool_timeout_s=3.0))()
    assert calc.toolbox.timeout_s == 3.0 and [t["function"]["name"] for t in calc.tools] == ["add"]
    config = AgentConfig(env="test_env_runner:ToolUser", env_kwargs={"bonus": 0.5},
                         tools=["test_env_runner:add"], tool_timeout_s=2.0)  # fmt: skip
    env = env_maker(config)()
    assert isinstance(env, ToolUser) and env.answer_checker("", None) == 0.5
    assert (list(env.toolbox.tools), env.toolbox.timeout_s) == (["add"], 2.0)
    with pytest.raises(ValueError, match="cannot load"):
        env_maker(AgentConfig(env="test_env_runner:Missing"))


async def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_every_job_is_answered_once_in_order_and_a_reclaimed_one_counts_a_restart(
    renderer, nowhere, redis_client, keys
):
    config = agent(reclaim_idle_s=0.5)
    service = EnvService(redis_client, keys, config)
    await service.start()
    batch = [EpisodeJob(f"e{i}", TASK) for i in range(5)]
    running = asyncio.create_task(service.run_episodes(batch, SETTINGS))
    queue = env_queue(redis_client, keys)  # a Consumer: the dying worker reads with it
    await wait_for(lambda: _has(queue, len(batch)))
    taken = await queue.read("a-worker-that-dies", 1, 1000)  # read, never answered
    group = JobWorkerPool(lambda: None)
    runner = EpisodeRunner(RaisingEnv, renderer, nowhere, config)
    for lane in range(2):
        group.add(EnvWorker(env_queue(redis_client, keys), runner, f"lane-{lane}", 0.5))
    outcomes = await asyncio.wait_for(running, 60)
    await group.stop()
    assert [o.episode_id for o in outcomes] == [job.episode_id for job in batch]
    assert all("no such task" in o.error for o in outcomes) and not group.crashed
    restarted = {o.episode_id for o in outcomes if o.restarts}
    assert restarted == {_episode_of(taken[0].payload)}
    assert runner.played == len(batch)


async def test_a_caller_that_gives_up_stops_the_episode_being_played(
    renderer, nowhere, redis_client, keys
):
    config = agent(step_timeout_s=30.0, episode_timeout_s=60.0)
    service = EnvService(redis_client, keys, config)
    await service.start()
    group = JobWorkerPool(lambda: None)
    runner = EpisodeRunner(lambda: SlowEnv(30.0), renderer, nowhere, config)
    lane = EnvWorker(env_queue(redis_client, keys), runner, "lane-0", 10.0)
    group.add(lane)
    running = asyncio.create_task(service.run_episodes([EpisodeJob("long", TASK)], SETTINGS))
    queue = env_queue(redis_client, keys)
    await wait_for(lambda: _pending(queue))  # the lane is playing it
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await wait_for(lambda: _withdrawn(lane))
    await group.stop()
    assert service.jobs.withdrawn == 1 and lane.runner.played == 0


async def _pending(queue) -> bool:
    return await queue.pending_count() == 1


async def _withdrawn(lane: EnvWorker) -> bool:
    return lane.withdrawn == 1


async def _has(queue, entries: int) -> bool:
    return await queue.length() >= entries


def _episode_of(payload: bytes) -> str:
    return json.loads(payload)["job"]["episode_id"]
