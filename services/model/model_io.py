"""Loading models and tokenizers, turning prompts into token ids, and greedy completions.

Why one module: the trainer, refcritic, the hf rollout backend, the model build script and the
tests must agree on how a prompt becomes token ids (chat template or not, special tokens or
not); a mismatch silently changes what the policy is trained on. transformers always reads a
local directory: a Hub model id in ``model.path`` is first resolved to its snapshot in the
Hugging Face cache (``local_model_dir``; downloaded only when not cached and not offline), so
loading itself never reaches the network. torch and transformers are imported inside functions
so that importing this module stays cheap.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from rlfleet.common.errors import InvalidArgument

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


_GENERIC_FAST = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def _saved_as_generic_fast(path: Path) -> bool:
    """True when `path` holds a tokenizer.json saved as a plain fast tokenizer."""
    config = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config.is_file():
        return False
    return json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") in _GENERIC_FAST


def local_model_dir(path: str | Path) -> Path:
    """`path` as a local model directory: the directory itself when it exists, else the
    cached (or, when online, downloaded) snapshot of the Hugging Face Hub model it names
    (``rlfleet.model.hub``); else FileNotFoundError("model path not found: ...").

    Why resolve here and hand transformers (and vLLM) a directory: transformers takes a
    folder that does not exist for a Hub id and, with local files only, reports that it could
    not connect to huggingface.co, which hides the real cause (usually a relative path and a
    different working directory, or a model that was never downloaded).
    """
    directory = Path(path).expanduser()
    if directory.is_dir():
        return directory
    from rlfleet.model.hub import is_repo_id, resolve_hub_model

    if is_repo_id(str(path)):
        return resolve_hub_model(str(path))
    raise FileNotFoundError(
        f"model path not found: {path} (model.path must be a local Hugging Face model "
        f"directory or a Hub model id like Qwen/Qwen2.5-0.5B-Instruct; relative paths are "
        f"read from {Path.cwd()} or the rlfleet checkout)"
    )


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in `path` (a Hugging Face directory or Hub id, see
    `local_model_dir`), read from local files only.

    transformers 5's AutoTokenizer swaps in Qwen2Tokenizer (byte-level pre-tokenizer and
    decoder) for every qwen2 model, whatever tokenizer.json says. A tokenizer saved as a plain
    fast tokenizer (like the default job's character tokenizer) is therefore loaded directly,
    exactly as its tokenizer.json defines it.
    """
    path = local_model_dir(path)
    if _saved_as_generic_fast(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    # imported only here: AutoTokenizer pulls in every model's auto classes (torch and more),
    # ~3 CPU-s a process that the router and env workers of the default job never need
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_causal_lm(
    path: str | Path, dtype: str = "float32", attn_implementation: str | None = None
) -> Any:
    """The causal LM saved in `path` (a directory or Hub id, see `local_model_dir`), in
    `dtype`, in eval mode, read from local files only; `attn_implementation` picks the
    attention kernel (None: transformers' default)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(local_model_dir(path)),
        dtype=getattr(torch, dtype),
        local_files_only=True,
        **({"attn_implementation": attn_implementation} if attn_implementation else {}),
    )
    log.debug("loaded %s (%s, %d parameters)", path, dtype, model.num_parameters())
    return model.eval()


ChatTemplate = Literal["auto"] | bool
"""``data.apply_chat_template``: ``auto`` applies the tokenizer's chat template to chat-message
prompts when the tokenizer has one; ``true`` always applies it (a plain-string prompt becomes one
user message; a tokenizer without a template is an error); ``false`` never does."""


def uses_chat_template(tokenizer: Any, prompt: str | Messages, mode: ChatTemplate = "auto") -> bool:
    """Whether `prompt` goes through the tokenizer's chat template under `mode`."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "auto":
        return has_template and not isinstance(prompt, str)
    if mode and not has_template:
        raise InvalidArgument(
            "data.apply_chat_template=true but the tokenizer has no chat template "
            "(use auto or false, or a model whose tokenizer_config.json has one)"
        )
    return bool(mode)


def prompt_text(tokenizer: Any, prompt: str | Messages, mode: ChatTemplate = "auto") -> str:
    """The text the model sees for `prompt` (see `ChatTemplate` for `mode`).

    Without the template a plain string stays raw and chat messages become their contents
    joined, which is what tiny models without a template (like the default job's) were
    trained on. With it, the template renders the messages and opens the assistant's turn.
    """
    if not uses_chat_template(tokenizer, prompt, mode):
        return prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompt(tokenizer: Any, prompt: str | Messages, mode: ChatTemplate = "auto") -> list[int]:
    """Token ids for `prompt` (a string or chat messages), with the tokenizer's special tokens.

    When a chat template already starts with the BOS token, the tokenizer is not asked to add
    it again, so the ids never hold a doubled BOS.
    """
    text = prompt_text(tokenizer, prompt, mode)
    bos = getattr(tokenizer, "bos_token", None)
    templated = uses_chat_template(tokenizer, prompt, mode)
    add_special = not (templated and bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add_special).input_ids)


def _left_padded(tokenizer: Any, rows: list[list[int]]) -> tuple[Any, Any]:
    """A left-padded id tensor and its attention mask, so generation starts in the same column."""
    import torch

    width = max(len(row) for row in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


def greedy_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str | Messages],
    max_new_tokens: int = 4,
    batch_size: int = 256,
) -> list[str]:
    """Greedy completions (decoded, special tokens dropped) for `prompts`, batched."""
    import torch

    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        rows = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        ids, mask = _left_padded(tokenizer, rows)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        new = out[:, ids.shape[1] :]
        texts.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return texts
