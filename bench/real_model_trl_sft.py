"""The SFT warm-up of ``real_model_trl.py``: what the fleet's ``trainer.sft_warmup_steps`` does,
done the way a TRL user does it (``SFTTrainer`` on the same demonstrations, then GRPO).

Why: when the recipe opens with supervised steps on worked solutions, a comparison that gave
TRL GRPO alone would measure the warm-up, not the trainers. TRL gets the same demonstrations
(``data.sft_files``, as prompt-completion conversations: TRL's loss then covers the assistant
turn only, as the fleet's does), the same steps, rows per step and learning rate, on the same
model object its GRPOTrainer then trains, and the warm-up's time counts on its training clock.
TRL starts GRPO with a fresh optimizer (two trainers); the fleet's Adam state carries over.
"""

from __future__ import annotations

import argparse
import time

import common


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sft-file", default="", help="demonstrations (verl SFT Parquet)")
    parser.add_argument("--sft-steps", type=int, default=0, help="warm-up steps (0: none)")
    parser.add_argument("--sft-lr", type=float, default=5e-5, help="the warm-up's lr")
    parser.add_argument("--sft-batch", type=int, default=16, help="conversations per step")


def prompt_completion_rows(path: str) -> list[dict]:
    """Each conversation split at its first assistant turn: TRL's conversational
    prompt-completion shape."""
    from pathlib import Path

    from rlfleet.trainer.data import read_rows
    from rlfleet.trainer.sft import conversation_of

    rows = []
    for index, row in enumerate(read_rows(Path(path).expanduser())):
        messages = conversation_of(row, f"{path}:{index + 1}")
        first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
        rows.append({"prompt": messages[:first], "completion": messages[first:]})
    return rows


def sft_config(args: argparse.Namespace, settings: dict):
    from trl import SFTConfig

    return SFTConfig(
        **settings,
        per_device_train_batch_size=args.sft_batch,
        max_steps=args.sft_steps,
        learning_rate=args.sft_lr,
        max_length=args.max_prompt_length + args.max_tokens,
        packing=False,
    )


def warm_up(
    args: argparse.Namespace, model, tokenizer, record: dict, evaluate, settings: dict
) -> None:
    """``args.sft_steps`` of SFTTrainer on ``model`` in place, on the training clock;
    held-out scored before (``record['val_before']``) and after (a curve point).
    ``settings``: what the run's GRPOTrainer is given alike (``run_settings``)."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import SFTTrainer

    record["val_before"] = evaluate(model, 0)
    trainer = SFTTrainer(
        model=model,
        args=sft_config(args, settings),
        train_dataset=Dataset.from_list(prompt_completion_rows(args.sft_file)),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)
    started = time.perf_counter()
    trainer.train()
    spent = time.perf_counter() - started
    record["training_time_s"] += spent
    record["sft"] = {"steps": args.sft_steps, "time_s": spent, "lr": args.sft_lr}
    common.progress(f"trl sft warm-up: {args.sft_steps} steps in {spent:.0f} s")
    evaluate(model, args.sft_steps)
