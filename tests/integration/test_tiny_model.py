"""The committed tiny policy loads through model_io and is a usable starting point for RL.

Its warm start stopped in an accuracy band on purpose: good enough to earn rewards, bad enough
to leave room to improve. These checks catch a model or tokenizer that drifted from that.
"""

import json
from pathlib import Path

import pytest

from rlfleet.model.model_io import encode_prompt, load_causal_lm, load_tokenizer
from rlfleet.tasks.arith import from_verl_record
from rlfleet.tasks.arith_eval import greedy_accuracy

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "tiny-qwen2-arith"
TEST_FILE = ROOT / "data" / "arith" / "test.jsonl"
ALPHABET = "0123456789+="

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return load_causal_lm(MODEL_DIR)


def test_vocab_and_special_tokens(tokenizer, model):
    vocab = tokenizer.get_vocab()
    assert len(vocab) == 16 == model.config.vocab_size
    assert set(ALPHABET) | {"<pad>", "<bos>", "<eos>", "<unk>"} == set(vocab)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert model.config.bos_token_id == 1 and model.config.eos_token_id == 2
    assert model.config.pad_token_id == 0
    assert model.generation_config.eos_token_id == 2


def test_tokenization_round_trip(tokenizer):
    ids = tokenizer("12+34=").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list("12+34=")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+34="
    assert tokenizer.decode(tokenizer("198", add_special_tokens=False).input_ids) == "198"
    assert tokenizer.convert_ids_to_tokens(tokenizer("7x", add_special_tokens=False).input_ids) == [
        "7",
        "<unk>",
    ]


def test_encode_prompt_accepts_text_and_chat_messages(tokenizer):
    from_text = encode_prompt(tokenizer, "5+93=")
    from_chat = encode_prompt(tokenizer, [{"role": "user", "content": "5+93="}])
    assert from_text == from_chat == [1, *tokenizer.convert_tokens_to_ids(list("5+93="))]


def test_auto_tokenizer_agrees_on_the_alphabet(tokenizer):
    """vLLM loads tokenizers with AutoTokenizer (which picks Qwen2Tokenizer for qwen2 models);
    it must encode and decode the task's strings exactly like model_io does."""
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)
    for text in ["12+34=", "0+0=", "99+99=", "198", "+="]:
        assert auto(text).input_ids == tokenizer(text).input_ids
        assert auto.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text


def test_greedy_accuracy_in_warm_start_band(model, tokenizer):
    problems = [from_verl_record(json.loads(line)) for line in TEST_FILE.open()][:200]
    batched = greedy_accuracy(model, tokenizer, problems)
    assert 0.2 <= batched <= 0.6
    assert greedy_accuracy(model, tokenizer, problems[:40], batch_size=1) == pytest.approx(
        greedy_accuracy(model, tokenizer, problems[:40], batch_size=40)
    )
