"""Teacher-forced scoring on vLLM: the prompt log-probs of one request.

Why a request and not a forward of our own: the model lives in vLLM's worker process with
its weights repacked, so the only forward we can ask for is a request. ``prompt_logprobs=0``
returns, for every prompt position after the first, the log-prob of the prompt's own token
there; sending prompt + targets as the prompt and reading the targets' positions is exactly
teacher forcing. vLLM computes prompt log-probs from the raw logits (its sampling processors
and ``logprobs_mode`` do not apply: ``log_softmax(logits)`` at temperature 1), and skips
reading the prefix cache for such a request (cached positions would have no log-probs), so
the scores come from the weights loaded now, whatever the cache holds. One token is
generated and dropped (``max_tokens`` must be at least 1).
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.errors import Internal


def scoring_params() -> Any:
    """Sampling parameters of a scoring request (greedy, one token, no text)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        temperature=0.0,
        max_tokens=1,
        prompt_logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def target_logprobs(output: Any, prompt: list[int], targets: list[int]) -> list[float]:
    """The targets' log-probs from a final ``RequestOutput`` of prompt + targets."""
    steps = output.prompt_logprobs
    if steps is None or len(steps) != len(prompt) + len(targets):
        count = "none" if steps is None else len(steps)
        raise Internal(f"vLLM returned {count} prompt log-probs for {len(prompt) + len(targets)}")
    picked = steps[len(prompt) :]
    return [float(step[token].logprob) for token, step in zip(targets, picked, strict=True)]
