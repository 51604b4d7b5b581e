"""Prompt data in verl's schema: JSONL or Parquet rows with ``prompt`` (chat messages or a
string), ``data_source``, ``reward_model.ground_truth`` and optional ``extra_info``.

Prompts are tokenized once at load time with the policy's tokenizer
(``rlfleet.model.model_io.encode_prompt``, the one function every role tokenizes prompts
with) and too-long prompts are rejected loudly.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rlfleet.common.errors import InvalidArgument


@dataclass
class PromptRecord:
    prompt: Any
    """Chat messages (list of {role, content}) or a plain string."""
    data_source: str
    ground_truth: Any
    """Any JSON value (verl's ``reward_model.ground_truth``), handed to the scorer as is."""
    extra_info: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    index: int = -1
    """Position among the rows of the files it was loaded from, read in order (-1: not loaded
    from files); ``data_order.jsonl`` names prompts by it."""

    def score_request(self, request_id: str, text: str):
        """The reward service's request to score ``text`` as an answer to this prompt."""
        from rlfleet.reward.types import ScoreRequest

        return ScoreRequest(
            id=request_id,
            data_source=self.data_source,
            solution_str=text,
            ground_truth=self.ground_truth,
            extra_info=self.extra_info,
            prompt=self.prompt_text,
        )

    @property
    def prompt_text(self) -> str:
        """The question as text, for scorers that read it (a judge, a reward model): the
        prompt itself, or the last user message of a chat prompt."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [
            m.get("content") for m in self.prompt if isinstance(m, dict) and m.get("role") == "user"
        ]
        return users[-1] if users and isinstance(users[-1], str) else ""


def read_rows(path: str | Path) -> list[dict]:
    """Rows of one JSONL or Parquet (``.parquet``) file, as plain dicts and lists.

    Parquet is read with pyarrow straight to Python values (verl's ``prompt`` list of
    ``{role, content}`` structs becomes a list of dicts, ``reward_model`` a dict), so numbers
    keep their exact values and nothing comes back as a numpy array.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidArgument(f"data file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with path.open(encoding="utf-8") as handle:
        return [_json_line(line, f"{path}:{n}") for n, line in enumerate(handle, 1) if line.strip()]


def _json_line(line: str, where: str) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(
            f"{where}: not JSON ({exc}); data files are JSONL or .parquet"
        ) from exc


def to_record(row: dict, where: str) -> PromptRecord:
    try:
        prompt = row["prompt"]
        truth = row["reward_model"]["ground_truth"]
    except (KeyError, TypeError) as exc:
        raise InvalidArgument(f"{where}: missing field {exc} (verl schema expected)") from exc
    prompt = list(prompt) if not isinstance(prompt, str) else prompt
    extra = row.get("extra_info") or {}
    return PromptRecord(prompt, str(row.get("data_source", "")), truth, dict(extra))


def load_records(
    files: list[str], tokenizer, max_prompt_length: int, chat_template: Any = "auto"
) -> list[PromptRecord]:
    """Read, validate and tokenize every row of ``files``; ``chat_template`` is
    ``data.apply_chat_template`` (``auto``, True or False; see ``model_io.ChatTemplate``)."""
    from rlfleet.model.model_io import encode_prompt

    records: list[PromptRecord] = []
    for file in files:
        for index, row in enumerate(read_rows(file)):
            record = to_record(row, f"{file}:{index + 1}")
            record.token_ids = list(encode_prompt(tokenizer, record.prompt, chat_template))
            record.index = len(records)
            if len(record.token_ids) > max_prompt_length:
                raise InvalidArgument(
                    f"{file}:{index + 1}: prompt has {len(record.token_ids)} tokens "
                    f"> data.max_prompt_length={max_prompt_length}"
                )
            records.append(record)
    if not records:
        raise InvalidArgument(f"no prompts found in {files}")
    return records


Row = TypeVar("Row")


def batches(records: Sequence[Row], batch_size: int, seed: int) -> Iterator[list[Row]]:
    """Endless shuffled batches (of prompts, or of SFT conversations); each epoch reshuffles
    with ``seed + epoch``."""
    if not 1 <= batch_size <= len(records):
        raise InvalidArgument(f"batch size {batch_size} must be in [1, {len(records)} prompts]")
    epoch = 0
    while True:
        order = list(range(len(records)))
        random.Random(seed + epoch).shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [records[i] for i in order[start : start + batch_size]]
        epoch += 1
