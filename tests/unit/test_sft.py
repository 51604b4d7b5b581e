"""``trainer.mode: sft``: the loss, conversations to tokens and masks, the actor's step, config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlfleet.common.config import load_config
from rlfleet.common.errors import InvalidArgument
from rlfleet.rl.sft import sft_loss
from rlfleet.trainer.sft import (
    SftBatch,
    conversation_of,
    encode_conversation,
    load_sft_records,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class CharTokenizer:
    """One token per character (its code point); a chat template of ``<role>content|``
    turns, the generation prompt ``<assistant>``; EOS is ``$``."""

    eos_token = "$"
    bos_token = None

    def __init__(self, template: bool = True) -> None:
        self.chat_template = "fake" if template else None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=True):
        class Encoded:
            input_ids = [ord(c) for c in text]

        return Encoded()


def text_of(ids):
    return "".join(chr(i) for i in ids)


def learned_text(record):
    return "".join(chr(t) for t, m in zip(record.response_ids, record.loss_mask, strict=True) if m)


# --- the loss ----------------------------------------------------------------------------


def test_sft_loss_is_the_mean_nll_of_the_masked_tokens():
    logprob = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = sft_loss(logprob, mask, "token-mean")
    assert loss.item() == pytest.approx((1 + 2 + 0.5) / 3)  # -3 and -4 are not trained
    assert metrics["train/loss"] == pytest.approx(3.5 / 3)
    per_sequence, _ = sft_loss(logprob, mask, "seq-mean-token-mean")
    assert per_sequence.item() == pytest.approx((1.5 + 0.5) / 2)


def test_sft_loss_gradient_reaches_only_masked_tokens():
    logprob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = sft_loss(logprob, torch.tensor([[1.0, 0.0]]))
    loss.backward()
    assert logprob.grad.tolist() == [[-1.0, 0.0]]


# --- rows to conversations -----------------------------------------------------------------


def test_rows_in_each_accepted_shape_become_conversations():
    user = {"role": "user", "content": "2+2="}
    answer = {"role": "assistant", "content": "4"}
    assert conversation_of({"messages": [user, answer]}, "f:1") == [user, answer]
    assert conversation_of({"prompt": [user], "response": "4"}, "f:1") == [user, answer]
    assert conversation_of({"prompt": "2+2=", "response": "4"}, "f:1") == [user, answer]
    assert conversation_of({"prompt": [user, answer]}, "f:1") == [user, answer]


def test_a_row_with_no_assistant_turn_is_refused_by_name():
    with pytest.raises(InvalidArgument, match=r"f\.jsonl:3: an SFT row has no assistant turn"):
        conversation_of({"prompt": [{"role": "user", "content": "2+2="}]}, "f.jsonl:3")
    with pytest.raises(InvalidArgument, match="needs 'messages' or 'prompt'"):
        conversation_of({"response": "4"}, "f.jsonl:4")


# --- tokens and masks ------------------------------------------------------------------------


def test_single_turn_prompt_is_the_rl_prompt_and_the_answer_with_its_end_is_learned():
    tok = CharTokenizer()
    record = encode_conversation(
        tok, conversation_of({"prompt": "2+2=", "response": "4"}, "f"), "auto"
    )
    assert text_of(record.prompt_ids) == "<user>2+2=|<assistant>"  # as encode_prompt opens it
    assert text_of(record.response_ids) == "4|"
    assert record.loss_mask == [1, 1]  # the answer and the turn's end: the model learns to stop


def test_multi_turn_learns_every_assistant_turn_and_only_those():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "D"},
        {"role": "user", "content": "ignored: after the last answer"},
    ]
    record = encode_conversation(CharTokenizer(), messages, "auto")
    assert text_of(record.prompt_ids) == "<system>be brief|<user>a|<assistant>"
    assert text_of(record.response_ids) == "B|<user>c|<assistant>D|"
    assert learned_text(record) == "B|D|"
    assert len(record.loss_mask) == len(record.response_ids)


def test_without_a_template_the_turns_are_joined_and_the_last_ends_with_eos():
    tok = CharTokenizer(template=False)
    record = encode_conversation(
        tok, conversation_of({"prompt": "2+2=", "response": "4"}, "f"), "auto"
    )
    assert text_of(record.prompt_ids) == "2+2="
    assert text_of(record.response_ids) == "4$"
    assert record.loss_mask == [1, 1]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    class Rewriting(CharTokenizer):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            # marks the last message specially: a prefix renders differently inside the whole
            text = super().apply_chat_template(messages, tokenize, add_generation_prompt)
            return f"[{len(messages)}]" + text

    with pytest.raises(InvalidArgument, match="incrementally"):
        encode_conversation(
            Rewriting(), conversation_of({"prompt": "a", "response": "b"}, "f"), "auto"
        )


def test_loading_refuses_a_conversation_longer_than_the_limits(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": "2+2=", "response": "4"}, {"prompt": "2+2=", "response": "four!"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tok = CharTokenizer(template=False)
    assert len(load_sft_records([str(path)], tok, 16, 6, "auto")) == 2
    with pytest.raises(InvalidArgument, match=r"sft\.jsonl:2: 4 prompt / 6 response tokens"):
        load_sft_records([str(path)], tok, 16, 5, "auto")
    empty = tmp_path / "no_answer.jsonl"
    empty.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(InvalidArgument, match="no assistant turn"):
        load_sft_records([str(empty)], tok, 16, 6, "auto")


# --- the actor's step ------------------------------------------------------------------------


def sft_actor(micro: int = 0):
    from tiny_models import random_qwen2

    from rlfleet.trainer.actor import Actor

    overrides = [
        "trainer.mode=sft",
        "trainer.lr=0.01",
        f"trainer.ppo_micro_batch_size={micro}",
        "data.train_batch_size=4",
        "rollout.n=1",
        "trainer.use_kl_loss=false",
    ]
    config = load_config(None, overrides)
    return Actor(config, random_qwen2(hidden=16, layers=1, heads=2, kv_heads=1), pad_id=0)


def toy_batch() -> tuple[SftBatch, torch.Tensor]:
    from rlfleet.trainer.rollout_batch import response_mask

    batch = SftBatch(
        [[1, 4, 5], [1, 6], [1, 4, 5], [1, 7]],
        [[8, 9, 2], [10, 2], [11, 12, 2], [13, 14, 2]],
        [[1, 1, 1], [1, 1], [1, 0, 1], [1, 1, 1]],
    )
    return batch, response_mask([len(r) for r in batch.responses], batch.loss_masks)


def test_the_actor_learns_the_demonstrations():
    actor = sft_actor()
    batch, mask = toy_batch()
    first = actor.sft_update(batch, mask)
    for _ in range(10):
        last = actor.sft_update(batch, mask)
    assert last["train/loss"] < first["train/loss"] - 0.5
    assert first["actor/grad_norm"] > 0 and first["actor/lr"] == pytest.approx(0.01)
    assert actor.objective == "rl"  # the RL loss is back for whatever runs next


def test_micro_batches_give_the_loss_of_the_whole_batch():
    batch, mask = toy_batch()
    whole = sft_actor(micro=0).sft_update(batch, mask)
    parts = sft_actor(micro=1).sft_update(batch, mask)
    assert parts["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-5)
    assert parts["actor/grad_norm"] == pytest.approx(whole["actor/grad_norm"], rel=1e-4)


# --- config ------------------------------------------------------------------------------------


def test_sft_mode_needs_no_reference_critic_or_groups():
    config = load_config(
        None,
        [
            "trainer.mode=sft",
            "rollout.n=1",
            "algorithm.adv_estimator=gae",
            "trainer.use_kl_loss=true",
            "trainer.kl_loss_coef=0.1",
        ],
    )
    assert not config.needs_reference and not config.needs_critic and not config.needs_refcritic


def test_sft_mode_refuses_what_it_does_not_run():
    with pytest.raises(Exception, match="trainer.mode=sft with agent.env"):
        load_config(CONFIGS / "agent_calc.yaml", ["trainer.mode=sft"])
    with pytest.raises(Exception, match="trainer.mode=sft with trainer.strategy"):
        load_config(None, ["trainer.mode=sft", "trainer.strategy=ddp", "trainer.world_size=2"])


def test_what_the_template_adds_after_the_eos_token_is_not_learned():
    class NewlineAfterEos(CharTokenizer):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            text = "".join(f"<{m['role']}>{m['content']}$\n" for m in messages)
            return text + ("<assistant>" if add_generation_prompt else "")

    record = encode_conversation(
        NewlineAfterEos(), conversation_of({"prompt": "a", "response": "b"}, "f"), "auto"
    )
    assert text_of(record.response_ids) == "b$\n"
    assert record.loss_mask == [1, 1, 0]  # the engine stops at EOS; the newline is context


def test_the_warmup_steps_take_their_own_learning_rate_then_the_rl_one():
    from tiny_models import random_qwen2

    from rlfleet.trainer.actor import Actor

    overrides = [
        "trainer.lr=1e-5",
        "trainer.sft_warmup_steps=2",
        "trainer.sft_warmup_lr=5e-5",
        "trainer.lr_schedule=constant",
        "data.sft_files=[demos.jsonl]",
    ]
    config = load_config(CONFIGS / "default.yaml", overrides, env={})
    actor = Actor(config, random_qwen2(hidden=16, layers=1, heads=2, kv_heads=1), pad_id=0)
    batch, mask = toy_batch()
    used = []
    for _ in range(3):
        used.append(actor.optimizer.param_groups[0]["lr"])  # the rate this update steps with
        actor.sft_update(batch, mask)
    assert used == pytest.approx([5e-5, 5e-5, 1e-5])


def test_a_warmup_rate_without_warmup_steps_is_refused_at_load():
    with pytest.raises(ValueError, match="sft_warmup_lr is the rate of"):
        load_config(CONFIGS / "default.yaml", ["trainer.sft_warmup_lr=1e-4"], env={})


def test_a_warmup_without_demonstrations_is_refused_at_load():
    with pytest.raises(ValueError, match="needs data.sft_files"):
        load_config(CONFIGS / "default.yaml", ["trainer.sft_warmup_steps=2"], env={})
    with pytest.raises(ValueError, match="leaves no RL step"):
        load_config(
            CONFIGS / "default.yaml",
            ["trainer.sft_warmup_steps=2", "trainer.total_steps=2", "data.sft_files=[x.jsonl]"],
            env={},
        )


async def test_a_warmup_resumed_inside_it_does_the_steps_left_on_unseen_batches(monkeypatch):
    """A run checkpointed after warm-up step 2 of 4 does steps 3 and 4 on the batches after
    the two it trained, leaves the RL data position alone, and waits for its last push."""
    from types import SimpleNamespace

    from rlfleet.trainer import sft
    from rlfleet.trainer.data import batches

    config = load_config(
        CONFIGS / "default.yaml",
        ["trainer.sft_warmup_steps=4", "data.sft_files=[demos.jsonl]", "data.sft_batch_size=2"],
        env={},
    )
    records = list(range(10))  # stand-ins: the step only sees which records it got
    monkeypatch.setattr(sft, "load_sft_records", lambda *args: records)
    trained, finished = [], []

    async def fake_step(trainer, batch):
        trained.append(batch)
        trainer.batches_consumed += 1  # as sft_step does
        return {"sft/trained_tokens": 1.0}

    async def no_wait():
        return None

    async def finish():
        finished.append(True)

    monkeypatch.setattr(sft, "sft_step", fake_step)
    trainer = SimpleNamespace(
        config=config,
        step=2,
        batches_consumed=7,
        tokenizer=None,
        wait_if_paused=no_wait,
        pushes=SimpleNamespace(finish=finish),
    )

    async def step_done(metrics):
        trainer.step += 1

    await sft.warm_up(trainer, step_done, lambda: False)
    order = batches(records, 2, config.data.seed)
    expected = [next(order) for _ in range(4)][2:]
    assert trained == expected and trainer.step == 4
    assert trainer.batches_consumed == 7 and finished == [True]
    await sft.warm_up(trainer, step_done, lambda: False)  # past the warm-up: nothing
    assert len(trained) == 2
