"""The critic's state travels with the trainer's checkpoints: a GAE run asks the refcritic to
save the critic into ``<checkpoint>/critic`` and, on resume, to load it back. A fake refcritic
records the calls (the real round trip runs in tests/integration/test_exact_resume.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from tiny_models import random_qwen2
from trainer_fakes import CountingReward, RecordingSync, SamplingRollout

from rlfleet.common.config import load_config
from rlfleet.refcritic.client import CheckpointInfo
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.fleet import Fleet, RefCritic
from rlfleet.trainer.run import restore, restore_critic, save_full_checkpoint
from rlfleet.trainer.trainer import Trainer


class RecordingCritic(RefCritic):
    """Writes a marker where the refcritic would write the critic; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def ref_logprobs(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]:
        raise AssertionError("not called by checkpoints")

    async def values(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]:
        raise AssertionError("not called by checkpoints")

    async def update_critic(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        returns: list[list[float]],
        old_values: list[list[float]],
    ) -> dict[str, float]:
        raise AssertionError("not called by checkpoints")

    async def save_checkpoint(self, path: str) -> CheckpointInfo:
        self.calls.append(("save", path))
        Path(path).mkdir(parents=True)
        (Path(path) / "critic.json").write_text(json.dumps({"step": 7}))
        return CheckpointInfo(path, 7)

    async def load_checkpoint(self, path: str) -> CheckpointInfo:
        self.calls.append(("load", path))
        return CheckpointInfo(path, 7)

    async def close(self) -> None:
        pass


class Tokenizer:
    def save_pretrained(self, path) -> None:
        (Path(path) / "tokenizer.marker").write_text("x")


def make_trainer(tmp_path: Path, estimator: str, critic: RecordingCritic, **extra) -> Trainer:
    settings = {
        "run_dir": str(tmp_path),
        "algorithm.adv_estimator": estimator,
        "trainer.use_kl_loss": "false",
        **extra,
    }
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()], env={})
    model = random_qwen2(hidden=32, layers=1, heads=2, kv_heads=1, vocab=16)
    fleet = Fleet(SamplingRollout(model), CountingReward(), critic, RecordingSync())
    return Trainer(config, fleet, Actor(config, model, pad_id=0), Tokenizer())


def test_a_gae_checkpoint_holds_the_critic_and_resume_loads_it(tmp_path):
    critic = RecordingCritic()
    trainer = make_trainer(tmp_path, "gae", critic)
    trainer.step, trainer.version = 3, 4
    checkpoint = tmp_path / "checkpoints" / "global_step_3"
    asyncio.run(save_full_checkpoint(trainer, checkpoint))
    critic_dir = str((checkpoint / "critic").resolve())
    assert critic.calls == [("save", critic_dir)]
    assert (checkpoint / "trainer_state.pt").is_file()

    resumed = make_trainer(tmp_path, "gae", critic)  # resume_mode auto finds global_step_3
    asyncio.run(restore_critic(resumed, restore(resumed)))
    assert (resumed.step, resumed.resumed_version) == (3, 4)
    assert critic.calls[-1] == ("load", critic_dir)


def test_runs_without_a_critic_never_call_the_refcritic(tmp_path):
    critic = RecordingCritic()
    trainer = make_trainer(tmp_path, "grpo", critic)
    asyncio.run(save_full_checkpoint(trainer, tmp_path / "checkpoints" / "global_step_1"))
    resumed = make_trainer(tmp_path, "grpo", critic)
    asyncio.run(restore_critic(resumed, restore(resumed)))
    assert critic.calls == [] and resumed.step == 0


def test_a_checkpoint_without_a_critic_keeps_the_services_critic(tmp_path, caplog):
    """A GRPO checkpoint continued as a GAE run: nothing to load, said in the log."""
    trainer = make_trainer(tmp_path, "grpo", RecordingCritic())
    asyncio.run(save_full_checkpoint(trainer, tmp_path / "checkpoints" / "global_step_1"))
    critic = RecordingCritic()
    resumed = make_trainer(tmp_path, "gae", critic)
    with caplog.at_level(logging.WARNING, logger="rlfleet.trainer.run"):
        asyncio.run(restore_critic(resumed, restore(resumed)))
    assert critic.calls == [] and "holds no critic" in caplog.text


def test_the_in_reward_kl_coefficient_is_restored(tmp_path):
    extra = {"algorithm.use_kl_in_reward": "true", "algorithm.kl_ctrl.type": "adaptive"}
    trainer = make_trainer(tmp_path, "grpo", RecordingCritic(), **extra)
    trainer.kl_ctrl.value = 0.0123
    asyncio.run(save_full_checkpoint(trainer, tmp_path / "checkpoints" / "global_step_1"))
    resumed = make_trainer(tmp_path, "grpo", RecordingCritic(), **extra)
    restore(resumed)
    assert resumed.kl_ctrl.value == 0.0123
