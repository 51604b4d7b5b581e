"""Turn-by-turn rendering: prompt + sampled + environment ids equal the template's full render.

Runs on the fixture tokenizer (the pinned agent format) and, once it is built, on
models/tiny-qwen2-agent itself, so the shipped policy's template is held to the same rule.
"""

from __future__ import annotations

from itertools import takewhile
from pathlib import Path

import pytest
from agent_fixtures import CHAT_TEMPLATE, agent_tokenizer, build_tokenizer, encode, ids_of

from rlfleet.agent.render import ChatRenderer, TemplateError
from rlfleet.tasks import calc

AGENT_MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-agent"


@pytest.fixture(params=["fixture", "tiny-qwen2-agent"])
def tokenizer(request: pytest.FixtureRequest) -> object:
    if request.param == "fixture":
        return agent_tokenizer()
    if not (AGENT_MODEL / "tokenizer.json").exists():
        pytest.skip("models/tiny-qwen2-agent is not built")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(AGENT_MODEL)


def test_environment_ids_are_what_follows_the_end_of_turn() -> None:
    renderer = ChatRenderer(agent_tokenizer())
    tool = {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "46"}
    expected = encode("\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n")
    assert renderer.environment_ids([tool]) == expected
    assert renderer.environment_ids([]) == encode("\n<|im_start|>assistant\n")


def assistant_turn_ids(renderer: ChatRenderer, history: list[dict], message: dict) -> list[int]:
    """What the template renders for an assistant message, through its end-of-turn token: the
    tokens a policy that writes exactly the template's format samples."""
    before = renderer.render_ids(history, add_generation_prompt=True)
    after = renderer.render_ids([*history, message])
    assert after[: len(before)] == before
    turn = after[len(before) :]
    return turn[: len(turn) - turn[::-1].index(renderer.end_of_turn_id)]


def turn_by_turn(renderer: ChatRenderer, messages: list[dict]) -> list[int]:
    """The opening messages' prompt, then per assistant turn its template tokens and the
    environment ids of the messages that answer it: what an episode's ids are."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    history = messages[:first]
    ids = renderer.initial_prompt_ids(history)
    for i in range(first, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        ids += assistant_turn_ids(renderer, history, messages[i])
        history = [*history, messages[i]]
        observation = list(takewhile(lambda m: m["role"] != "assistant", messages[i + 1 :]))
        if observation:
            ids += renderer.environment_ids(observation)
            history += observation
    return ids


@pytest.mark.parametrize("numbers", [(12, 34, 56), (10, 99, 45, 77)])
@pytest.mark.parametrize("system", [None, "Use the tool."])
def test_turn_by_turn_ids_equal_the_full_render(
    tokenizer: object, numbers: tuple, system: str | None
) -> None:
    renderer = ChatRenderer(tokenizer)
    messages = calc.ideal_messages(calc.Problem(numbers), system=system)
    ids = turn_by_turn(renderer, messages)
    full = renderer.render_ids(messages)
    assert ids == full[: len(ids)]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert full[len(ids) :] == newline  # the template's "\n" after the last <|im_end|>


def test_closing_and_decoding_of_a_turn() -> None:
    renderer = ChatRenderer(agent_tokenizer())
    eos = agent_tokenizer().eos_token_id
    call = encode('<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>')
    assert renderer.closing_ids(call + [eos]) == []
    assert renderer.closing_ids(call) == [eos] and renderer.closing_ids([]) == [eos]
    assert renderer.decode_turn(call + [eos]).startswith("<tool_call>{")
    assert renderer.decode_turn(ids_of("12", "ab")) == "12ab"


def test_a_template_that_is_not_prefix_stable_is_refused() -> None:
    last_differs = CHAT_TEMPLATE.replace(
        "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}",
        # like thinking blocks dropped from earlier turns: an assistant turn renders
        # differently once something follows it
        "{%- if loop.last or message['role'] != 'assistant' -%}{{- message['content'] -}}"
        "{%- else -%}{{- '0' -}}{%- endif -%}",
    )
    assert last_differs != CHAT_TEMPLATE
    with pytest.raises(TemplateError, match="not prefix-stable"):
        ChatRenderer(build_tokenizer(last_differs))


def test_a_template_without_a_matching_generation_prompt_is_refused() -> None:
    other_prompt = CHAT_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>\\n'")
    assert other_prompt != CHAT_TEMPLATE
    with pytest.raises(TemplateError, match="generation prompt"):
        ChatRenderer(build_tokenizer(other_prompt))


def test_a_turn_must_end_with_the_end_of_turn_token() -> None:
    with pytest.raises(TemplateError, match="does not end an assistant turn"):
        ChatRenderer(agent_tokenizer(), end_of_turn_id=ids_of("ab")[0])
