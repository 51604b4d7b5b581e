"""A small tokenizer with the agent policy's pinned chat template, and scripted environments.

Why here and not models/tiny-qwen2-agent: the episode tests must not wait for a model build.
The tokenizer follows the pinned format of the tiny agent policy (a WordLevel vocabulary over
single characters, the ChatML and tool-call tokens as whole tokens, ``<|im_end|>`` = eos), plus
a few multi-character "merged" entries ("12", "ab", ...) that encoding never produces but a
policy may sample, as a BPE model may sample a non-canonical split. Those are the tokens that
do not survive a decode/encode round trip, which the zero-drift test needs.
"""

from __future__ import annotations

import functools
from typing import Any

SPECIAL = ["<pad>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<unk>"]
WORDS = ["system", "user", "assistant", "tool", '"name"', '"arguments"', '"add"', '"a"', '"b"']
CHARS = list('0123456789+={}:," \n')
MERGED = ["12", "ab", "34", ":{", "im"]  # sampled only: encoding splits text into characters

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{%- if args is not string -%}{%- set args = args | tojson(separators=(',', ':')) -%}"
    "{%- endif -%}"
    "{{- '<tool_call>{\"name\":\"' + call['function']['name'] + '\",\"arguments\":' + args"
    " + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML; an assistant's calls render compact after its content; ``tools`` is ignored."""


@functools.cache
def agent_tokenizer() -> Any:
    """The fixture tokenizer (a PreTrainedTokenizerFast), built once per test process."""
    return build_tokenizer(CHAT_TEMPLATE)


def build_tokenizer(chat_template: str) -> Any:
    """The fixture vocabulary with any chat template (tests of templates that must fail)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS + CHARS + MERGED)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(""), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL[1:5],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(WORDS)
    tokenizer.chat_template = chat_template
    return tokenizer


def encode(text: str) -> list[int]:
    return agent_tokenizer()(text, add_special_tokens=False)["input_ids"]


def ids_of(*tokens: str) -> list[int]:
    return agent_tokenizer().convert_tokens_to_ids(list(tokens))


class ScriptedGenerator:
    """A TurnGenerator that samples the given texts (canonically tokenized, eos appended) or
    token lists in turn, honouring ``max_tokens`` like an engine (cut -> ``length``). It records
    every call, so tests can check what each turn was given."""

    def __init__(self, turns: list[str | list[int]], version: int = 7) -> None:
        self.turns, self.version = list(turns), version
        self.calls: list[tuple[list[int], Any, str]] = []

    async def __call__(self, prompt_ids: list[int], sampling: Any, session_id: str) -> Any:
        from rlfleet.agent.loop import SampledTurn

        self.calls.append((list(prompt_ids), sampling, session_id))
        turn = self.turns[min(len(self.calls), len(self.turns)) - 1]
        ids = turn if isinstance(turn, list) else encode(turn) + [agent_tokenizer().eos_token_id]
        cut = ids[: sampling.max_tokens]
        reason = "length" if len(cut) < len(ids) else "stop"
        logprobs = [-0.5 - 0.25 * (i % 4) for i in range(len(cut))]
        return SampledTurn(cut, logprobs, self.version, reason)
