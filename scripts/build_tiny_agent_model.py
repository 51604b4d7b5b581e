"""Build the agent job's tiny tool-using Qwen2 policy: a ChatML tokenizer with tool-call tokens,
a small Qwen2 model, and a short, shaped supervised warm start on calc episodes.

Why: the agent job must show RL improving a multi-turn, tool-calling policy on a CPU in minutes.
A random model never calls `add` correctly and a fully trained one leaves nothing to learn.
A warm start stopped early on ideal episodes leaves the wrong thing to learn: its failures are
wrong operands spread over every call, which RL on a CPU fixed slowly (0.23 -> 0.30 in
80 steps, docs/agents.md). So the warm start is shaped instead: it learns 3-number sums well,
but on 4-number sums most of its training episodes (`--early-share`, 0.6) answer one call
early (the running total after two calls), so that the greedy policy stops early on 4-number
sums while sampling still makes the third call in the rest: one frequent, rewarded choice
for RL to reinforce. Training stops once greedy held-out *episode* success (whole episodes,
tools run) on 3-number sums reaches `--target-3`; overall success then sits well below the
ceiling (band 0.25-0.6). Like scripts/build_tiny_model.py, whose training pieces it reuses,
the model is a real Qwen2 so vLLM, transformers and the trainer load it as usual.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# `python scripts/...` puts scripts/ on the import path: reuse the arith build's training pieces.
from build_tiny_model import padded_batch, save, train_step

from rlfleet.agent.render import ChatRenderer
from rlfleet.agent.tool_calls import ParsedTurn, parse_tool_calls
from rlfleet.tasks.calc import (
    Problem,
    add,
    check_answer,
    from_verl_record,
    ideal_messages,
    prompt_messages,
)

log = logging.getLogger(__name__)

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
WORDS = ["system", "user", "assistant", "tool", '"name"', '"arguments"', '"add"', '"a"', '"b"']
CHARS = [*"0123456789", "+", "=", "{", "}", ":", ",", '"', "Ġ", "Ċ"]
"""Single characters; space and newline are stored as their byte-level forms Ġ and Ċ, so that
transformers' Qwen2Tokenizer (which AutoTokenizer, and so vLLM, picks for any qwen2 model)
reads the same vocabulary and encodes this alphabet to the same ids."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\":' + (fn.name | tojson) + ',\"arguments\":' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}"
    "{%- else %}{{- fn.arguments | tojson(separators=(',', ':')) }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML; tool calls as compact `<tool_call>{"name":..,"arguments":{..}}</tool_call>` after the
content (arguments given as an object or as OpenAI's JSON string); `tools` is accepted and not
rendered (the policy knows its one tool from training)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/tiny-qwen2-agent", help="output directory")
    parser.add_argument("--data", default="data/calc", help="directory with train/test.jsonl")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (head size 32)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps-max", type=int, default=2500, help="give up after this many")
    parser.add_argument(
        "--early-share",
        type=float,
        default=0.6,
        help="share of 4-number training episodes that answer one call early",
    )
    parser.add_argument(
        "--target-3",
        type=float,
        default=0.85,
        help="stop once greedy held-out success on 3-number sums reaches this",
    )
    parser.add_argument("--target-low", type=float, default=0.25, help="band on all sums")
    parser.add_argument("--target-high", type=float, default=0.6, help="band on all sums")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between evaluations")
    parser.add_argument("--eval-n", type=int, default=200, help="held-out episodes per eval")
    parser.add_argument("--n-sft", type=int, default=8000, help="training episodes to use")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def build_tokenizer() -> Any:
    """WordLevel over the vocabulary above; each character is a token, the chat and tool words
    are atomic added tokens, anything else is `<unk>`; no BOS; eos is `<|im_end|>`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(""), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in WORDS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL[2:],
        model_max_length=512,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: Any, args: argparse.Namespace) -> Any:
    """A freshly initialised Qwen2 with head size 32 (the smallest vLLM's CPU attention takes)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64),
        intermediate_size=2 * args.hidden,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config).float()


@dataclass(frozen=True)
class Success:
    """Greedy held-out episode success: on all problems, on 3-number and on 4-number sums."""

    all: float
    three: float
    four: float

    def __str__(self) -> str:
        return f"{self.all:.3f} (3-num {self.three:.3f}, 4-num {self.four:.3f})"


@dataclass
class WarmStart:
    """What the warm start reached, for the log and the model card."""

    steps: int
    success: Success
    seconds: float
    history: list[tuple[int, Success]]


def early_messages(problem: Problem) -> list[dict]:
    """The ideal episode cut one call short: after the second call and its reply, the assistant
    answers that reply's running total (the sum of the first three numbers), a wrong answer.

    Why: mixed into the 4-number episodes, it makes the warm start stop one call early on
    4-number sums while still making the third call in a good share of sampled episodes, so the
    one thing RL has to learn is a frequent, rewarded choice.
    """
    messages = ideal_messages(problem)
    if len(problem.numbers) < 4:
        raise ValueError(f"only 4-number sums answer early, got {problem.prompt}")
    return [*messages[:-3], {"role": "assistant", "content": messages[-4]["content"]}]


def sft_messages(problems: list[Problem], early_share: float, seed: int) -> list[list[dict]]:
    """The warm start's episodes: ideal ones, except that a seeded `early_share` of the
    4-number problems get `early_messages` instead."""
    rng = random.Random(seed)
    return [
        early_messages(p)
        if len(p.numbers) == 4 and rng.random() < early_share
        else ideal_messages(p)
        for p in problems
    ]


def assistant_ids(tokenizer: Any, message: dict) -> list[int]:
    """The tokens the policy samples for an assistant `message`, up to and with `<|im_end|>`."""
    text = tokenizer.apply_chat_template([message], tokenize=False)
    body = text.removeprefix("<|im_start|>assistant\n").removesuffix("\n")
    return list(tokenizer(body, add_special_tokens=False).input_ids)


def sft_example(renderer: Any, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token-native ids of an ideal episode, as the episode runner builds them (prompt, sampled
    turns, `environment_ids` between them), and labels that keep only the assistant's tokens."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = renderer.initial_prompt_ids(messages[:first])
    labels, pending = [-100] * len(ids), []
    for message in messages[first:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            env = renderer.environment_ids(pending)
            ids, labels, pending = ids + env, labels + [-100] * len(env), []
        turn = assistant_ids(renderer.tokenizer, message)
        ids, labels = ids + turn, labels + turn
    return ids, labels


def greedy_turns(model: Any, tokenizer: Any, rows: list[list[int]], max_new: int) -> list:
    """One greedy assistant turn for each id row: new ids up to and with `<|im_end|>`, or the
    `max_new` ids generated when it never came."""
    import torch

    width, pad, eos = max(map(len, rows)), tokenizer.pad_token_id, tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )
    new = [row[width:].tolist() for row in out]
    return [row[: row.index(eos) + 1] if eos in row else row for row in new]


def call_add(call: dict) -> str:
    """The tool reply to one parsed call: `add`'s result, or an error observation."""
    try:
        if call["function"]["name"] != "add":
            return "error: unknown tool"
        arguments = json.loads(call["function"]["arguments"])
        return str(add(int(arguments["a"]), int(arguments["b"])))
    except (KeyError, TypeError, ValueError):
        return "error: add takes integers a and b"


def tool_messages(turn: ParsedTurn) -> list[dict]:
    """One `role: tool` reply per call the turn attempted (malformed ones too), in call order."""
    good = [(c["id"], call_add(c)) for c in turn.tool_calls]
    bad = [(e.id, f"error: {e.reason}") for e in turn.errors]
    in_order = sorted(good + bad, key=lambda pair: int(pair[0].removeprefix("call_")))
    return [{"role": "tool", "tool_call_id": i, "content": c} for i, c in in_order]


def episode_rewards(turns: Callable, renderer: Any, problems: list, max_turns: int = 5) -> list:
    """Whole episodes, batched over problems: `turns(rows)` samples each turn until
    `<|im_end|>`, its tool calls run, the replies are appended as template tokens, and so on;
    reward 1.0 when the final answer (a turn without calls) is right within `max_turns`.

    Small on purpose: the agent work of issue 17 replaces it with its episode runner.
    """
    rows = [renderer.initial_prompt_ids(prompt_messages(p)) for p in problems]
    rewards, active = [0.0] * len(problems), list(range(len(problems)))
    for _ in range(max_turns):
        still = []
        for i, new in zip(active, turns([rows[i] for i in active]) if active else [], strict=True):
            if new[-1:] != [renderer.end_of_turn_id]:
                continue  # the turn never ended: the episode is truncated
            turn = parse_tool_calls(renderer.decode_turn(new))
            if not turn.attempted:
                rewards[i] = check_answer(turn.content, problems[i].answer)
                continue
            rows[i] += new + renderer.environment_ids(tool_messages(turn))
            still.append(i)
        active = still
    return rewards


def mean_where(rewards: list[float], keep: list[bool]) -> float:
    """The mean of the rewards `keep` marks (0.0 when it marks none)."""
    kept = [r for r, k in zip(rewards, keep, strict=True) if k]
    return sum(kept) / len(kept) if kept else 0.0


def success_rate(model: Any, renderer: Any, problems: list[Problem]) -> Success:
    """Greedy held-out episode success of `model` (transformers) on `problems`, overall and by
    how many numbers a problem sums (the warm start treats the two kinds differently)."""
    model.eval()
    turns = partial(greedy_turns, model, renderer.tokenizer, max_new=40)
    rewards = episode_rewards(turns, renderer, problems)
    counts = [len(p.numbers) for p in problems]
    return Success(
        all=sum(rewards) / len(problems),
        three=mean_where(rewards, [c == 3 for c in counts]),
        four=mean_where(rewards, [c == 4 for c in counts]),
    )


def sft(model: Any, renderer: Any, train: list, test: list, args: argparse.Namespace) -> WarmStart:
    """Train on the shaped episodes until greedy held-out success on 3-number sums reaches
    `--target-3`, or steps run out."""
    import torch

    episodes = sft_messages(train[: args.n_sft], args.early_share, args.seed)
    examples = [sft_example(renderer, messages) for messages in episodes]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    history, start = [(0, success_rate(model, renderer, test))], time.perf_counter()
    for step in range(1, args.steps_max + 1):
        idx = torch.randint(len(examples), (args.batch_size,), generator=gen).tolist()
        inputs, labels = zip(*(examples[i] for i in idx), strict=True)
        loss = train_step(model, optimizer, padded_batch(inputs, labels, model.config.pad_token_id))
        if step % args.eval_every == 0:
            history.append((step, success_rate(model, renderer, test)))
            log.info("step %d loss %.3f success %s", step, loss, history[-1][1])
            if history[-1][1].three >= args.target_3:
                break
    return WarmStart(history[-1][0], history[-1][1], time.perf_counter() - start, history)


def load_split(path: Path) -> list:
    return [from_verl_record(json.loads(line)) for line in path.open(encoding="utf-8")]


def model_card(args: argparse.Namespace, result: WarmStart, n_params: int, full: Success) -> str:
    """The README saved next to the weights: what it is, how it was built, what it measured."""
    shown = [(s, a) for s, a in result.history if s % 250 == 0 or s >= result.steps - 50]
    curve = ", ".join(f"{s}: {a.all:.3f}/{a.three:.3f}/{a.four:.3f}" for s, a in shown)
    heads, kv_heads = args.hidden // 32, max(1, args.hidden // 64)
    return f"""# tiny-qwen2-agent

A {n_params:,}-parameter Qwen2-architecture causal LM that solves sums of 3 or 4 two-digit
numbers (`12+34+56=`) by calling an `add(a, b)` tool over several turns: the starting policy
of rlfleet's agent job (task `rlfleet.tasks.calc`). Built by
`python scripts/build_tiny_agent_model.py` (seed {args.seed}).

- Tokenizer: `tokenizers` WordLevel, {len(SPECIAL + WORDS + CHARS)} tokens. Special:
  `<pad> <unk> <|im_start|> <|im_end|> <tool_call> </tool_call>`; added words: `system user
  assistant tool "name" "arguments" "add" "a" "b"`; characters `0-9 + = {{ }} : , "`, space
  and newline (stored as the byte-level `Ġ`, `Ċ`). Any other character is `<unk>`; no BOS;
  eos = `<|im_end|>`.
- Chat template: ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`), an assistant's tool
  calls as `<tool_call>{{"name":"add","arguments":{{"a":12,"b":34}}}}</tool_call>` after its
  content, `tool` messages with role `tool`; a `tools` argument is accepted, not rendered.
- Model: hidden {args.hidden}, {args.layers} layers, {heads} heads (head size 32), {kv_heads} KV
  heads, intermediate {2 * args.hidden}, tied embeddings, 512 positions, float32.
- Warm start, shaped on purpose so that RL has one clear thing to learn: supervised on
  episodes of {args.n_sft} problems of `{args.data}/train.jsonl` (AdamW lr {args.lr}, batch
  {args.batch_size}, loss on assistant tokens only). 3-number sums get their ideal episode;
  of the 4-number sums, a seeded {args.early_share:.0%} get an episode that **answers one call
  early** (after the second call it answers that call's result, the sum of the first three
  numbers: wrong) and the rest their ideal episode. So the greedy policy is good at 3-number
  sums and stops one call early on 4-number ones, while sampled episodes still make the
  third call in part; RL is meant to raise success by learning to make that call. Stopped once
  greedy held-out success on the 3-number sums among the first {args.eval_n} problems of
  `{args.data}/test.jsonl` reached {args.target_3:.2f} (band on all sums
  {args.target_low:.2f}-{args.target_high:.2f}). An episode: greedy turns until
  `<|im_end|>`, `add` run for each call, success when the final answer is right within 5
  assistant turns.
- Result: **{result.steps} steps, {result.seconds:.0f} s (wall, shared 2-core CPU), held-out
  episode success {result.success}** on the first {args.eval_n}; on all of `test.jsonl`
  {full}.
- Success by step (all/3-num/4-num): {curve}.
- Decode sampled turns with `skip_special_tokens=False`: `<tool_call>` is a special token.
  AutoTokenizer (and so vLLM) loads this directory as Qwen2Tokenizer: same ids and the same
  chat template for the alphabet above, but unknown characters are dropped, not `<unk>`.
"""


def save_policy(model: Any, tokenizer: Any, out: Path, card: str) -> None:
    """build_tiny_model's `save`, with a default length that holds a whole tool-call turn."""
    save(model, tokenizer, out, card)
    model.generation_config.max_new_tokens = 40
    model.generation_config.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer = build_tokenizer()
    model, renderer = build_model(tokenizer, args), ChatRenderer(tokenizer)
    train, test = (
        load_split(Path(args.data) / "train.jsonl"),
        load_split(Path(args.data) / "test.jsonl"),
    )
    log.info("training %d parameters on %d episodes", model.num_parameters(), args.n_sft)
    result = sft(model, renderer, train, test[: args.eval_n], args)
    if not args.target_low <= result.success.all <= args.target_high:
        log.warning("success %s is outside the target band", result.success)
    full = success_rate(model, renderer, test)
    log.info(
        "success %s (all %d: %s) after %d steps, %.1f s",
        result.success,
        len(test),
        full,
        result.steps,
        result.seconds,
    )
    print("history:", " ".join(f"{s}:{a.all:.3f}/{a.three:.3f}" for s, a in result.history))
    save_policy(
        model, tokenizer, Path(args.out), model_card(args, result, model.num_parameters(), full)
    )
    log.info("saved to %s", args.out)


if __name__ == "__main__":
    main()
