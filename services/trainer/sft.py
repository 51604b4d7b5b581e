"""``trainer.mode: sft``: supervised steps on demonstration conversations, in the fleet.

A short warm-up on an answer format before RL (a model that never ends with ``Answer: N``
gets no reward to learn from) is a mode of the trainer, not a side script: the same data
files and loader (``data.train_files``), the same checkpoints, and the same weight pushes, so
the replicas serve each SFT step's weights and validation measures held-out accuracy through
the fleet exactly as in RL. The loss is ``rlfleet.rl.sft.sft_loss`` on the assistant tokens.

Rows are chat conversations with at least one assistant turn: a ``messages`` column (verl's
multi-turn SFT schema), or a chat ``prompt`` that ends in assistant turns, or a ``prompt``
(chat or string) plus a ``response`` string. Every assistant turn is learned (with the
template's end-of-turn markup, so the model learns to stop); the system and user turns, and
the template's text that opens each assistant turn, are context only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.common.errors import InvalidArgument
from rlfleet.model.model_io import ChatTemplate, encode_prompt, uses_chat_template
from rlfleet.trainer.data import batches, read_rows

if TYPE_CHECKING:
    from rlfleet.trainer.trainer import Trainer

log = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


@dataclass
class SftRecord:
    """One conversation as the actor trains it: the prompt before the first assistant turn,
    the tokens after it, and which of those are learned."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    """1 on assistant tokens of ``response_ids``, 0 on later user/system turns."""


@dataclass
class SftBatch:
    """A step's conversations in the shape the actor's forward takes (``prompts``,
    ``responses``), with their loss masks."""

    prompts: list[list[int]]
    responses: list[list[int]]
    loss_masks: list[list[int]]

    @classmethod
    def of(cls, records: list[SftRecord]) -> SftBatch:
        return cls(
            [r.prompt_ids for r in records],
            [r.response_ids for r in records],
            [r.loss_mask for r in records],
        )

    def __len__(self) -> int:
        return len(self.prompts)


def conversation_of(row: dict, where: str) -> Messages:
    """The chat messages of an SFT row (see the module docstring for the accepted shapes)."""
    messages = row.get("messages")
    if messages is None:
        prompt = row.get("prompt")
        if prompt is None:
            raise InvalidArgument(f"{where}: an SFT row needs 'messages' or 'prompt'")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if isinstance(row.get("response"), str):
            messages = [*messages, {"role": "assistant", "content": row["response"]}]
    messages = [dict(m) for m in messages]
    if not any(m.get("role") == "assistant" for m in messages):
        raise InvalidArgument(
            f"{where}: an SFT row has no assistant turn to learn (roles: "
            f"{[m.get('role') for m in messages]}); give 'messages' with an assistant message, "
            "or a 'response' string"
        )
    return messages


def text_pieces(tokenizer: Any, messages: Messages, mode: ChatTemplate) -> list[tuple[str, int]]:
    """The conversation after its first prompt as ``(text, learned)`` pieces, in order.

    With a chat template, piece boundaries come from rendering growing prefixes: an assistant
    turn is what rendering it adds to the prefix rendered with the generation prompt (its
    content and end-of-turn markup). Without one, turns are their contents joined (as the
    prompts of such models are), and the last assistant turn ends with the EOS token."""
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    templated = uses_chat_template(tokenizer, messages[: turns[0]], mode)
    pieces: list[tuple[str, int]] = []
    done = render(tokenizer, messages[: turns[0]], templated, opened=True)
    for n, turn in enumerate(turns):
        opened = render(tokenizer, messages[:turn], templated, opened=True)
        closed = render(tokenizer, messages[: turn + 1], templated, opened=False)
        if not templated and n == len(turns) - 1:
            closed += getattr(tokenizer, "eos_token", None) or ""
        if not (opened.startswith(done) and closed.startswith(opened)):
            raise InvalidArgument(
                "the chat template does not render this conversation incrementally (a prefix "
                "renders differently inside the whole); SFT needs one that does"
            )
        answer, after = split_after_eos(closed[len(opened) :], tokenizer)
        pieces += [(opened[len(done) :], 0), (answer, 1), (after, 0)]
        done = closed
    return [(text, learned) for text, learned in pieces if text]


def split_after_eos(turn: str, tokenizer: Any) -> tuple[str, str]:
    """An assistant turn cut after its EOS token (SmolLM2's ``<|im_end|>``): the engine stops
    there, so what the template adds after it (a newline) is context, never a target."""
    eos = getattr(tokenizer, "eos_token", None)
    end = turn.rfind(eos) + len(eos) if eos and eos in turn else len(turn)
    return turn[:end], turn[end:]


def render(tokenizer: Any, messages: Messages, templated: bool, opened: bool) -> str:
    """``messages`` as the model reads them; ``opened``: followed by the assistant's opening."""
    if not templated:
        return "".join(str(m.get("content", "")) for m in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=opened)


def encode_conversation(tokenizer: Any, messages: Messages, mode: ChatTemplate) -> SftRecord:
    """Token ids and loss mask of a conversation. The prompt is tokenized exactly as an RL
    prompt (``encode_prompt``) and each piece after it on its own, as the engine would
    generate it after that prompt."""
    first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
    prompt_ids = encode_prompt(tokenizer, messages[:first], mode)
    response, mask = [], []
    for text, learned in text_pieces(tokenizer, messages, mode):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        response += ids
        mask += [learned] * len(ids)
    return SftRecord(list(prompt_ids), response, mask)


def load_sft_records(
    files: list[str], tokenizer: Any, max_prompt: int, max_response: int, mode: ChatTemplate
) -> list[SftRecord]:
    """Every conversation of ``files``, tokenized; too-long rows are refused loudly (cut
    demonstrations would teach the model to stop mid-answer)."""
    records = []
    for file in files:
        for index, row in enumerate(read_rows(file)):
            where = f"{Path(file).name}:{index + 1}"
            record = encode_conversation(tokenizer, conversation_of(row, where), mode)
            if len(record.prompt_ids) > max_prompt or len(record.response_ids) > max_response:
                raise InvalidArgument(
                    f"{where}: {len(record.prompt_ids)} prompt / {len(record.response_ids)} "
                    f"response tokens > data.max_prompt_length={max_prompt} / "
                    f"rollout.max_tokens={max_response}"
                )
            records.append(record)
    if not records:
        raise InvalidArgument(f"no SFT rows found in {files}")
    return records


async def sft_step(trainer: Trainer, records: list[SftRecord]) -> dict[str, float]:
    """One supervised step on ``records``, then version + 1 published to the replicas."""
    from rlfleet.trainer.metrics import Timer
    from rlfleet.trainer.rollout_batch import response_mask

    timer = Timer()
    batch = SftBatch.of(records)
    with timer.phase("step"):
        mask = response_mask([len(r) for r in batch.responses], batch.loss_masks)
        with timer.phase("update_actor"):
            metrics = await asyncio.to_thread(trainer.actor.sft_update, batch, mask)
        trainer.batches_consumed += 1
        trainer.version += 1
        with timer.phase("push_weights"):
            metrics.update(await trainer.pushes.publish(trainer.version))
    metrics["sft/trained_tokens"] = float(mask.sum())
    metrics["training/weight_version"] = float(trainer.version)
    metrics.update(timer.metrics)
    return metrics


async def warm_up(
    trainer: Trainer,
    step_done: Callable[[dict[str, float]], Awaitable[None]],
    should_stop: Callable[[], bool],
) -> None:
    """``trainer.sft_warmup_steps``: supervised steps on ``data.sft_files`` before RL, each
    handed to ``step_done`` (the run's step bookkeeping: step count, metrics, checkpoints,
    validation). A run resumed inside the warm-up does the steps it has left on the batches it
    had not seen; the warm-up's batches are not RL data (``batches_consumed`` is the RL
    data's position). Returns once the last warm-up push has landed."""
    cfg = trainer.config
    steps = cfg.trainer.sft_warmup_steps
    if trainer.step >= steps:
        return
    data_cfg = cfg.data
    records = await asyncio.to_thread(
        load_sft_records,
        data_cfg.sft_files,
        trainer.tokenizer,
        data_cfg.max_prompt_length,
        cfg.rollout.max_tokens,
        data_cfg.apply_chat_template,
    )
    data = batches(records, data_cfg.sft_batch_size, data_cfg.seed)
    for _ in range(trainer.step):  # resumed inside the warm-up
        next(data)
    log.info(
        "SFT warm-up: %d steps of %d conversations (%d in %s)",
        steps - trainer.step,
        data_cfg.sft_batch_size,
        len(records),
        data_cfg.sft_files,
    )
    rl_position = trainer.batches_consumed
    while trainer.step < steps and not should_stop():
        await trainer.wait_if_paused()
        metrics = await sft_step(trainer, next(data))
        trainer.batches_consumed = rl_position
        await step_done(metrics)
    await trainer.pushes.finish()
