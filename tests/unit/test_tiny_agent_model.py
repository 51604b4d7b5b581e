"""The committed tiny tool-using policy: its tokenizer, chat template and config, as pinned.

Other environments and the agent gateway talk to this policy through its chat template and
tokenizer, so these checks pin what they render and encode; the episode core relies on each
message rendering on its own (a conversation's text is its messages' texts in order).
"""

from pathlib import Path

import pytest

from rlfleet.model.model_io import load_causal_lm, load_tokenizer
from rlfleet.tasks.calc import Problem, add, ideal_messages

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-agent"
CALL = '<tool_call>{"name":"add","arguments":{"a":12,"b":34}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL_DIR)


def test_special_tokens_and_eos(tokenizer):
    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    assert tokenizer.convert_tokens_to_ids(specials) == list(range(6))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 3
    assert tokenizer.pad_token_id == 0 and tokenizer.unk_token_id == 1
    assert tokenizer.bos_token is None
    assert len(tokenizer) == 34


@pytest.mark.parametrize("text", ["12+34+56=", "0123456789", "99+99+99+99=", "198", "+="])
def test_digits_plus_equals_round_trip_one_token_per_char(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == list(text)
    assert tokenizer.decode(ids) == text


def test_unknown_characters_become_unk(tokenizer):
    ids = tokenizer("7x é\t😀", add_special_tokens=False).input_ids
    seven, space, unk = tokenizer.convert_tokens_to_ids(["7", "Ġ", "<unk>"])
    assert ids == [seven, unk, space, unk, unk, unk]


def test_tool_call_words_are_single_tokens(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(CALL).input_ids)
    assert tokens[:8] == ["<tool_call>", "{", '"name"', ":", '"add"', ",", '"arguments"', ":"]
    assert tokens[-1] == "</tool_call>" and '"a"' in tokens and '"b"' in tokens
    assert tokenizer.decode(tokenizer(CALL).input_ids) == CALL


def test_chat_template_renders_every_role_and_tool_calls(tokenizer):
    from transformers.utils import get_json_schema

    messages = [
        {"role": "system", "content": "0"},
        {"role": "user", "content": "12+34="},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}},
            ],
        },
        {"role": "tool", "content": "46"},
        {"role": "assistant", "content": "46"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=[get_json_schema(add)], add_generation_prompt=True, tokenize=False
    )
    assert text == (
        "<|im_start|>system\n0<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n"
        f"<|im_start|>assistant\n{CALL}<|im_end|>\n<|im_start|>tool\n46<|im_end|>\n"
        "<|im_start|>assistant\n46<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert list(ids) == tokenizer(text).input_ids and tokenizer.decode(ids) == text


def test_openai_string_arguments_render_like_objects(tokenizer):
    messages = ideal_messages(Problem((12, 34, 56)))
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in text
    parts = [tokenizer.apply_chat_template([m], tokenize=False) for m in messages]
    assert text == "".join(parts)


def test_auto_tokenizer_agrees_on_the_alphabet(tokenizer):
    """vLLM loads the tokenizer with AutoTokenizer (Qwen2Tokenizer for a qwen2 model); it must
    render and encode the task's episodes exactly like model_io's tokenizer."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)
    messages = ideal_messages(Problem((12, 34, 56, 78)))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    for sample in [text, "12+34=", ' {}:,"\n']:
        assert auto(sample).input_ids == tokenizer(sample).input_ids
        assert auto.decode(tokenizer(sample).input_ids) == sample
    assert auto.eos_token_id == tokenizer.eos_token_id


def test_model_config_is_as_documented():
    model = load_causal_lm(MODEL_DIR)
    c = model.config
    assert c.model_type == "qwen2" and c.architectures == ["Qwen2ForCausalLM"]
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (128, 4, 2)
    assert c.hidden_size // c.num_attention_heads == 32
    assert c.max_position_embeddings == 512 and c.vocab_size == 34 and c.tie_word_embeddings
    assert c.eos_token_id == 3 and c.pad_token_id == 0
    assert model.generation_config.eos_token_id == 3
    assert model.num_parameters() < 2_000_000


def test_episode_renderer_appends_tool_replies_as_the_template_does(tokenizer):
    from rlfleet.agent.render import ChatRenderer

    renderer = ChatRenderer(tokenizer)
    assert renderer.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    env = renderer.environment_ids([{"role": "tool", "tool_call_id": "call_0", "content": "46"}])
    assert tokenizer.decode(env) == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"
