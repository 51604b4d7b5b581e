"""The seam between a rollout replica and its inference engine.

Why a small abstract class: the replica (queue, weight updates, registry) must not care whether
tokens come from vLLM's ``AsyncLLM`` or from transformers' ``generate``. Both backends honour the
same contract, so tests written against one hold for the other:

- ``generate`` returns exactly ``n`` completions in order; each carries the sampled token ids, the
  log-prob of each sampled token under ``log_softmax(logits / temperature)`` (temperature 0 counts
  as 1), the decoded text (special tokens dropped, cut before the first stop string), and a finish
  reason: ``stop`` (EOS produced, which stays in ``token_ids``, or a stop string), ``length``, or
  ``abort``.
- ``load_weights`` is one step: every name and shape is checked against the model before any
  parameter changes, so a mismatched update raises ``InvalidArgument`` and the old weights keep
  serving.
- ``stage_weights`` splits that step in two for the replica's pause (issue 29, "fetch before
  the pause"): everything that can be done while the old weights still serve (checks, casts,
  writing the file vLLM reads) happens there; the ``StagedWeights`` it returns holds only the
  swap, which the replica runs with admission closed. The default stages nothing and swaps
  with ``load_weights``, so an engine that knows no better still works.

This module imports neither torch nor vLLM: the backends (``hf.py``, ``vllm.py``) import it,
and ``factory.make_engine`` imports the configured backend only when a replica builds one.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from rlfleet.common.errors import FailedPrecondition, InvalidArgument
from rlfleet.rollout.types import Completion, SamplingParams

if TYPE_CHECKING:
    from rlfleet.common.config import RlfleetConfig

FINISH_REASONS = ("stop", "length", "abort")


class StagedWeights:
    """An update made ready while the old weights serve: ``apply`` swaps it in (the replica
    calls it with admission closed, at most once); ``discard`` drops it unapplied, or cleans
    up after ``apply`` (a file written for the engine), and may be called any number of
    times. ``changed`` counts the elements the swap writes (0: not counted)."""

    def __init__(
        self,
        apply: Callable[[], Awaitable[None]],
        cleanup: Callable[[], None] | None = None,
        changed: int = 0,
    ) -> None:
        self._apply, self._cleanup, self.changed = apply, cleanup, changed
        self._used = False

    async def apply(self) -> None:
        if self._used:
            raise RuntimeError("staged weights are applied (or discarded) once")
        self._used = True
        try:
            await self._apply()
        finally:
            self.discard()

    def discard(self) -> None:
        self._used = True
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup()


class Engine(abc.ABC):
    """One inference engine holding one copy of the policy."""

    name: str = "engine"
    tokenizer: Any = None

    def __init__(self, config: RlfleetConfig) -> None:
        self.config = config
        self.vocab_size = model_vocab_size(config.model.path)
        self.serving_version = 0
        """The weight version loaded (set by the replica's ``WeightUpdater`` after each load;
        vLLM salts its prefix cache with it)."""
        self.batches = 0
        """Forward batches run so far, where the backend forms them itself (hf: one per
        ``model.generate`` call); 0 where the engine batches internally (vLLM)."""

    @property
    def dtype(self) -> str:
        """The dtype this engine holds its parameters in (``rollout.dtype``, resolved here)."""
        from rlfleet.model.precision import serving_dtype

        model, rollout = self.config.model.dtype, self.config.rollout.dtype
        return serving_dtype(model, rollout, self.device_type())

    def device_type(self) -> str:
        """Where the engine computes (``auto`` dtypes are chosen for it)."""
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        """InvalidArgument unless every id is in the vocabulary and the sequence fits."""
        if prompt and self.vocab_size and max(prompt) >= self.vocab_size:
            raise InvalidArgument(f"prompt token id {max(prompt)} >= vocab size {self.vocab_size}")
        limit = self.config.rollout.max_model_len
        if len(prompt) + max_tokens > limit:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                f"> rollout.max_model_len {limit}"
            )

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and tokenizer; the engine serves after this returns."""

    @abc.abstractmethod
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> list[Completion]:
        """``sampling.n`` completions for one prompt; ``request_id`` must be unique in flight."""

    @abc.abstractmethod
    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the weights in one step; InvalidArgument (nothing changed) on a mismatch."""

    async def stage_weights(
        self, state_dict: Mapping[str, Any], changes: Mapping[str, Any] | None = None
    ) -> StagedWeights:
        """Ready ``state_dict`` (complete weights, or a LoRA adapter) for a swap, while the
        old weights serve; InvalidArgument (nothing changed) on a mismatch. ``changes``
        (``weights_delta.Part`` by tensor name), when given, says which elements differ from
        the weights loaded now: an engine may swap in only those. This default checks nothing
        early and swaps with ``load_weights``."""
        return StagedWeights(lambda: self.load_weights(state_dict))

    async def score_tokens(self, prompt: list[int], targets: list[int]) -> list[float]:
        """Teacher-forced ``log_softmax(logits)`` (temperature 1) of each of ``targets``
        given ``prompt`` and the targets before it, under the weights loaded now
        (``rlfleet.rollout.types.ScoreRequest``: the trainer's parity probe). This default
        cannot score: FailedPrecondition."""
        raise FailedPrecondition(f"the {self.name} engine cannot score tokens")

    def weight_numel(self) -> int:
        """Elements in every tensor an update may carry (tied ones too); 0 = not known, and
        then a replica cannot bound an update's size before it arrives."""
        return 0

    def prefix_cache_tokens(self) -> tuple[int, int] | None:
        """(prompt tokens looked up, prompt tokens served from the prefix cache) over the
        requests finished so far, for the replica's ``/metrics``; None where the engine keeps
        no prefix cache (hf), so no hit rate is reported rather than a false 0 %."""
        return None

    @abc.abstractmethod
    async def flush_cache(self) -> bool:
        """Drop cached KV/prefix state; True when the cache is now empty."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request early; its completions come back with finish_reason ``abort``."""

    async def interrupt(self) -> int:
        """Stop every request running now at its next step: their ``generate`` calls return
        the tokens decoded so far, finish reason ``abort`` (a weight update continues them:
        ``rollout.continuation``). Returns how many were stopped. An engine that cannot
        stop work keeps this default: updates then wait for its requests to finish."""
        return 0

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the engine (child processes, threads, memory)."""

    def is_alive(self) -> bool:
        """False once the engine can no longer serve (e.g. vLLM's engine process died)."""
        return True

    def encode(self, text: str) -> list[int]:
        """Token ids for a text prompt, the way the trainer tokenizes it."""
        from rlfleet.model.model_io import encode_prompt

        return encode_prompt(self.tokenizer, text)

    def decode(self, token_ids: list[int], stop: list[str]) -> tuple[str, bool]:
        """(text, hit_stop): the decoded text without special tokens, cut before a stop string."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return cut_at_stop(text, stop)


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def tokens_until_stop(token_ids: list[int], decode: Any, stop: list[str]) -> tuple[list[int], bool]:
    """The shortest prefix of ``token_ids`` whose text contains a stop string (vLLM keeps the
    token that completes a stop string, so we do too), or all ids and False."""
    if not stop:
        return token_ids, False
    for end in range(1, len(token_ids) + 1):
        if cut_at_stop(decode(token_ids[:end]), stop)[1]:
            return token_ids[:end], True
    return token_ids, False


def check_state_dict(
    state_dict: Mapping[str, Any],
    expected: Mapping[str, tuple[int, ...]],
    optional: frozenset[str] = frozenset(),
) -> None:
    """Refuse an update that does not match the model exactly.

    Every expected name must be present (a partial update could leave a fused vLLM layer
    half-loaded), no unknown name may appear, shapes must match, and values must be floating
    point. ``optional`` names (a tied ``lm_head.weight``) may be present or absent.
    """
    names = set(state_dict)
    unknown = sorted(names - set(expected) - optional)
    missing = sorted(set(expected) - names)
    if unknown or missing:
        raise InvalidArgument(
            f"weight names do not match the model: unknown={unknown[:5]} missing={missing[:5]}"
        )
    for name, tensor in state_dict.items():
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != tuple(want):
            raise InvalidArgument(f"tensor {name!r}: shape {tuple(tensor.shape)} != {tuple(want)}")
        if not tensor.dtype.is_floating_point:
            raise InvalidArgument(f"tensor {name!r}: dtype {tensor.dtype} is not floating point")


def model_vocab_size(model_path: str) -> int:
    """``vocab_size`` from the model's config.json (0 when it does not say, or when the model
    is not found: the backend's ``start`` reports that). A Hub id reads its cached snapshot."""
    from rlfleet.model.model_io import local_model_dir

    try:
        config = local_model_dir(model_path) / "config.json"
    except FileNotFoundError:
        return 0
    if not config.is_file():
        return 0
    raw = json.loads(config.read_text())
    return int(raw.get("vocab_size") or raw.get("text_config", {}).get("vocab_size") or 0)
