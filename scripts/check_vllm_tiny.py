"""Check that vLLM serves the tiny policy and agrees with transformers on greedy accuracy.

Why: the rollout service generates with vLLM while the trainer scores with transformers; if the
two disagree on the same weights, RL learns from the wrong policy. Run with
`VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/check_vllm_tiny.py`.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

# Run from a clean checkout (no `pip install -e .`): put the repo root on the import path.
from rlfleet.tasks.arith import from_verl_record, parse_answer

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen2-arith")
    parser.add_argument("--test", default="data/arith/test.jsonl")
    parser.add_argument("-n", type=int, default=200, help="held-out problems to check")
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile")
    return parser.parse_args(argv)


def vllm_completions(
    model_dir: str, id_rows: list[list[int]], eager: bool
) -> tuple[list[str], float]:
    """Greedy completions from vLLM for token-id prompts, and the engine start-up time."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype="float32",
        skip_tokenizer_init=False,
        max_model_len=64,
        enforce_eager=eager,
    )
    startup = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in id_rows], params)
    return [out.outputs[0].text for out in outputs], startup


def accuracy(texts: list[str], problems: list) -> float:
    return sum(
        parse_answer(t) == int(p.answer) for t, p in zip(texts, problems, strict=True)
    ) / len(problems)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from rlfleet.model.model_io import (
        encode_prompt,
        greedy_completions,
        load_causal_lm,
        load_tokenizer,
    )

    problems = [from_verl_record(json.loads(line)) for line in open(args.test)][: args.n]
    tokenizer = load_tokenizer(args.model)
    hf_texts = greedy_completions(
        load_causal_lm(args.model), tokenizer, [p.prompt for p in problems]
    )
    id_rows = [encode_prompt(tokenizer, p.prompt) for p in problems]
    vllm_texts, startup = vllm_completions(args.model, id_rows, args.enforce_eager)
    same = sum(a == b for a, b in zip(hf_texts, vllm_texts, strict=True))
    print(
        json.dumps(
            {
                "n": len(problems),
                "hf_accuracy": accuracy(hf_texts, problems),
                "vllm_accuracy": accuracy(vllm_texts, problems),
                "identical_completions": same,
                "vllm_startup_s": round(startup, 2),
                "enforce_eager": args.enforce_eager,
            }
        )
    )


if __name__ == "__main__":
    main()
