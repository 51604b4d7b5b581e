"""Env-worker doubles shared by the unit tests (``test_env_runner``: no Redis) and the
integration tests (``test_env_workers``: the env stream on a real Redis): environments that
fail or stall, the default job's tokenizer with a small chat template (``<bos>`` opens a user
turn, ``<eos>`` ends an assistant turn, so no tool-using model is needed), and a router
address nobody listens on.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from rlfleet.common.config.agent import AgentConfig
from rlfleet.common.redis_server import free_port
from rlfleet.env.runner import load_renderer
from rlfleet.env.types import EpisodeSettings
from rlfleet.rollout.client import RolloutClient
from rlfleet.rollout.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-qwen2-arith"
TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ m.content }}<eos>"
    "{%- else %}<bos>{{ m.content }}{%- endif %}{%- endfor %}"
)
TASK = {"prompt": [{"role": "user", "content": "1+1="}]}
SETTINGS = EpisodeSettings(SamplingParams(max_tokens=4), max_turns=2, max_episode_tokens=64)
NO_MODEL = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no tiny model")


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
