"""Build the default job's tiny Qwen2 policy: a character tokenizer, a 0.6M-parameter model,
and a short supervised warm start on two-digit addition.

Why: the default job must show RL improving a policy on a CPU in minutes. A random model never
earns a reward, and a fully trained one leaves nothing to learn, so the warm start stops as soon
as greedy held-out accuracy lands in a band (0.30-0.40 by default). The model is a real Qwen2
architecture so vLLM, transformers and the trainer treat it like any Hugging Face causal LM.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run from a clean checkout (no `pip install -e .`): put the repo root on the import path.

log = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
VOCAB = [PAD, BOS, EOS, UNK, *"0123456789", "+", "="]


@dataclass
class SftResult:
    """What the warm start reached, for the log and the model card."""

    steps: int
    accuracy: float
    seconds: float
    history: list[tuple[int, float]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/tiny-qwen2-arith", help="output directory")
    parser.add_argument("--data", default="data/arith", help="directory with train/test.jsonl")
    parser.add_argument("--steps-max", type=int, default=600, help="give up after this many")
    parser.add_argument("--target-acc-low", type=float, default=0.30)
    parser.add_argument("--target-acc-high", type=float, default=0.40)
    parser.add_argument("--eval-every", type=int, default=5, help="steps between evaluations")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_tokenizer() -> Any:
    """One token per character; <bos> prepended to every encoding; decoding joins characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=64,
        padding_side="left",
    )


def build_model(tokenizer: Any, seed: int) -> Any:
    """A freshly initialised Qwen2 with head size 32 (the smallest vLLM's CPU attention takes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(VOCAB),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def sft_rows(tokenizer: Any, problems: list) -> tuple[list[list[int]], list[list[int]]]:
    """Inputs [<bos>] + prompt + answer + [<eos>]; labels mask out <bos> and the prompt."""
    inputs, labels = [], []
    for p in problems:
        prompt = tokenizer(p.prompt, add_special_tokens=True).input_ids
        target = tokenizer(p.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        inputs.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    return inputs, labels


def padded_batch(inputs: list[list[int]], labels: list[list[int]], pad_id: int) -> dict:
    """Right-padded tensors for one training batch (padding is masked out of the loss)."""
    import torch

    width = max(len(row) for row in inputs)
    fill = [width - len(row) for row in inputs]
    return {
        "input_ids": torch.tensor([r + [pad_id] * f for r, f in zip(inputs, fill, strict=True)]),
        "attention_mask": torch.tensor(
            [[1] * len(r) + [0] * f for r, f in zip(inputs, fill, strict=True)]
        ),
        "labels": torch.tensor([r + [-100] * f for r, f in zip(labels, fill, strict=True)]),
    }


def train_step(model: Any, optimizer: Any, batch: dict) -> float:
    model.train()
    loss = model(**batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss)


def evaluate(model: Any, tokenizer: Any, problems: list) -> float:
    from rlfleet.tasks.arith_eval import greedy_accuracy

    model.eval()
    return greedy_accuracy(model, tokenizer, problems, max_new_tokens=4)


def sft(model: Any, tokenizer: Any, train: list, test: list, args: argparse.Namespace) -> SftResult:
    """Train until held-out greedy accuracy is in the target band, or steps run out."""
    import torch
    from tqdm import tqdm

    inputs, labels = sft_rows(tokenizer, train)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    history = [(0, evaluate(model, tokenizer, test))]
    start, bar = time.perf_counter(), tqdm(range(1, args.steps_max + 1), desc="sft", unit="step")
    for step in bar:
        idx = torch.randint(len(inputs), (args.batch_size,), generator=gen).tolist()
        batch = padded_batch(
            [inputs[i] for i in idx], [labels[i] for i in idx], tokenizer.pad_token_id
        )
        loss = train_step(model, optimizer, batch)
        if step % args.eval_every == 0:
            history.append((step, evaluate(model, tokenizer, test)))
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{history[-1][1]:.3f}")
            if history[-1][1] >= args.target_acc_low:
                break
    bar.close()
    return SftResult(history[-1][0], history[-1][1], time.perf_counter() - start, history)


def load_split(path: Path) -> list:
    import json

    from rlfleet.tasks.arith import from_verl_record

    return [from_verl_record(json.loads(line)) for line in path.open(encoding="utf-8")]


def model_card(args: argparse.Namespace, result: SftResult, n_params: int, n_test: int) -> str:
    """The README saved next to the weights: how it was built and what it measured."""
    shown = [(s, a) for s, a in result.history if s % 50 == 0 or s == result.steps]
    curve = ", ".join(f"{s}: {a:.3f}" for s, a in shown)
    return f"""# tiny-qwen2-arith

A {n_params:,}-parameter Qwen2-architecture causal LM for two-digit addition, the starting
policy of rlfleet's default GRPO job. Built by `scripts/build_tiny_model.py` (seed {args.seed}).

- Tokenizer: one token per character, 16 tokens: `<pad> <bos> <eos> <unk> 0-9 + =`.
  Every encoding starts with `<bos>`. Input `12+34=`, target `46<eos>`.
- Model: hidden 128, 4 layers, 4 attention heads (head size 32), 2 KV heads, intermediate 256,
  tied embeddings, max 64 positions, float32.
- Warm start: supervised on `{args.data}/train.jsonl` (AdamW lr {args.lr}, batch
  {args.batch_size}, loss on answer tokens and `<eos>` only), stopped once greedy accuracy on
  `{args.data}/test.jsonl` reached the band {args.target_acc_low:.2f}-{args.target_acc_high:.2f}
  so that RL has room to improve it.
- Result: **{result.steps} steps, {result.seconds:.1f} s, greedy held-out accuracy
  {result.accuracy:.3f}** on {n_test} held-out problems (4 new tokens, leading integer compared).
- Held-out accuracy by step: {curve}.
- Loading: use `rlfleet.model.model_io.load_tokenizer` (or `PreTrainedTokenizerFast`).
  transformers 5's `AutoTokenizer` substitutes `Qwen2Tokenizer` for any qwen2 model; it
  encodes and decodes this alphabet identically but drops unknown characters instead of
  mapping them to `<unk>`.
"""


def save(model: Any, tokenizer: Any, out: Path, card: str) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=8,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(card, encoding="utf-8")
    for path in out.iterdir():  # safetensors writes 0600; containers run as another user
        path.chmod(0o644)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed)
    train, test = (
        load_split(Path(args.data) / "train.jsonl"),
        load_split(Path(args.data) / "test.jsonl"),
    )
    log.info("training %d parameters on %d problems", model.num_parameters(), len(train))
    result = sft(model, tokenizer, train, test, args)
    if not args.target_acc_low <= result.accuracy <= args.target_acc_high:
        log.warning(
            "accuracy %.3f is outside the target band after %d steps", result.accuracy, result.steps
        )
    log.info(
        "held-out accuracy %.3f after %d steps (%.1f s)",
        result.accuracy,
        result.steps,
        result.seconds,
    )
    card = model_card(args, result, model.num_parameters(), len(test))
    save(model, tokenizer, Path(args.out), card)
    log.info("saved to %s", args.out)


if __name__ == "__main__":
    main()
