"""The ``reward_model`` scorer: a sequence-classification model scores each (prompt, response).

Why in the reward workers: a discriminative reward model (a causal LM with a score head,
``AutoModelForSequenceClassification``, as OpenRLHF and verl train them) is one forward pass
per item, so it belongs next to the other scorers, selected by ``data_source`` or by name, with
per-item errors and ``reward.default_score`` like any of them (``reward.reward_model``).

The model is loaded once per reward process, on its first item (its workers share it; a lock
keeps two first calls from loading it twice), from local files only. Each call scores all the
items it was given in forward passes of ``batch_size`` sequences, right-padded with attention
masks, so a score does not depend on what else was in the batch. The text of an item is the
tokenizer's chat template over a user message (the prompt) and an assistant message (the
response) when the tokenizer has one and the item has a prompt, else prompt + response. An
item longer than ``max_length`` tokens (or the model's context, if shorter) is refused with
that limit in its error, never truncated: a truncated response would be scored on a part of
it. With one label the score is the head's logit; with several, the softmax probability of
``label`` (the last by default).

Calls run on the built-in scorers' thread lanes (``batch_scorer``), under the service's item
timeout: a forward pass that takes too long costs its items an error, not a worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.common.config import RewardModelConfig, shipped_path
from rlfleet.model.model_io import load_tokenizer, local_model_dir
from rlfleet.reward.scorers.base import Scorer, error_result
from rlfleet.reward.types import ScoreRequest, ScoreResult

log = logging.getLogger(__name__)


@dataclass
class _Loaded:
    tokenizer: Any
    model: Any
    limit: int
    """Most tokens of one sequence: ``max_length``, or the model's context if shorter."""
    limit_name: str


class RewardModel:
    """Scores items with the sequence-classification model at ``config.path``."""

    def __init__(self, config: RewardModelConfig) -> None:
        self.config = config
        # relative paths as model.path reads them; a wrong one fails the service at start
        self.directory = local_model_dir(shipped_path(config.path))
        self._lock = threading.Lock()
        self._loaded: _Loaded | None = None
        self.forward_passes = 0

    def loaded(self) -> _Loaded:
        """The tokenizer and model, loaded on the first call of this process."""
        with self._lock:
            if self._loaded is None:
                self._loaded = self._load()
            return self._loaded

    def _load(self) -> _Loaded:
        import torch
        from transformers import AutoModelForSequenceClassification

        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        tokenizer = load_tokenizer(self.directory)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(self.directory), dtype=getattr(torch, self.config.dtype), local_files_only=True
        ).eval()
        if tokenizer.pad_token_id is None:  # padding is needed to batch; eos is a safe filler
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # the head pools the last token that is not pad
            model.config.pad_token_id = tokenizer.pad_token_id
        labels, label = model.config.num_labels, self.config.label
        if label is not None and not 0 <= label < labels:
            raise ValueError(
                f"reward.reward_model.label {label} is not a label of a {labels}-label model"
            )
        context = getattr(model.config, "max_position_embeddings", None)
        limit, name = self.config.max_length, "reward.reward_model.max_length"
        if context is not None and context < limit:
            limit, name = context, "the model's context (max_position_embeddings)"
        log.info(
            "reward model %s loaded: %d labels, %s, limit %d tokens",
            self.directory,
            model.config.num_labels,
            self.config.dtype,
            limit,
        )
        return _Loaded(tokenizer, model, limit, name)

    def text(self, tokenizer: Any, request: ScoreRequest) -> str:
        """What the model reads for one item (see the module docstring)."""
        prompt = request.prompt or request.extra_info.get("question") or ""
        prompt = prompt if isinstance(prompt, str) else str(prompt)
        if self.config.chat_template and prompt and getattr(tokenizer, "chat_template", None):
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": request.solution_str},
            ]
            return tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + request.solution_str

    def score_items(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Every item's result, in order; a too-long item is its own error."""
        loaded = self.loaded()
        results: list[ScoreResult | None] = [None] * len(requests)
        rows: list[tuple[int, list[int]]] = []
        for index, request in enumerate(requests):
            ids = loaded.tokenizer(self.text(loaded.tokenizer, request))["input_ids"]
            if len(ids) > loaded.limit:
                results[index] = error_result(
                    request.id,
                    f"reward model input is {len(ids)} "
                    f"tokens, more than {loaded.limit} "
                    f"({loaded.limit_name})",
                )
            else:
                rows.append((index, ids))
        size = self.config.batch_size
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            for (index, _), score in zip(
                chunk, self._scores(loaded, [ids for _, ids in chunk]), strict=True
            ):
                results[index] = ScoreResult(id=requests[index].id, score=score)
        return [r for r in results if r is not None]

    def _scores(self, loaded: _Loaded, rows: list[list[int]]) -> list[float]:
        """One forward pass over right-padded ``rows``: a score per row."""
        import torch

        pad = loaded.tokenizer.pad_token_id
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for row, ids in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, : len(ids)] = 1
        with torch.inference_mode():
            logits = loaded.model(input_ids=input_ids, attention_mask=mask).logits.float()
        self.forward_passes += 1
        if logits.shape[-1] == 1:
            return logits[:, 0].tolist()
        label = logits.shape[-1] - 1 if self.config.label is None else self.config.label
        return torch.softmax(logits, dim=-1)[:, label].tolist()


@dataclass
class RewardModelScorer(Scorer):
    """The ``reward_model`` as a scorer: one call for all of a list's items (batched)."""

    reward_model: RewardModel | None = None

    def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        assert self.reward_model is not None
        try:
            return self.reward_model.score_items(requests)
        except Exception as exc:  # noqa: BLE001 - a failed load or forward fails these items
            return self.failed(requests, exc)


def reward_model_scorer(config: RewardModelConfig) -> Scorer:
    model = RewardModel(config)
    label = "the logit (one label) or label probability"
    return RewardModelScorer(
        name="reward_model",
        kind="model",
        fn=model.score_items,
        reward_model=model,
        blocking=True,
        batched=True,
        takes_prompt=True,
        data_sources=list(config.data_sources),
        description=f"sequence-classification model {config.path}: {label}",
    )
