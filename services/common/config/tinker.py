"""The ``tinker`` section: the trainer serves a Tinker-compatible training API instead of
running its own loop (``rlfleet.trainer.tinker``; docs/tinker.md)."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config.base import Section


class TinkerConfig(Section):
    enabled: bool = False
    """When true, ``rlfleet trainer`` (so the trainer of ``rlfleet up``) runs no training loop:
    it serves the Tinker API over HTTP for clients that drive their own loop (the official
    ``tinker`` SDK with ``base_url``), training LoRA adapters on ``model.path`` and sampling
    through the fleet's router. Needs ``model.lora_rank`` > 0: the largest rank a client may
    ask for, which the replicas are started with."""
    host: str = "127.0.0.1"
    """Interface of the API's HTTP server (loopback by default; set ``api_key`` before opening
    it wider: the SDK sends the key as ``X-API-Key`` and it must start with ``tml-``)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the API; 0 = a free port picked at start. The base URL is recorded as the
    ``tinker`` entry of ``run_dir/endpoints.json`` (``{"http": URL}``)."""
    max_adapters: int = Field(4, ge=1, le=64)
    """How many LoRA training clients may exist at once (over all sessions); one more is
    refused, naming this limit. They share one copy of the base model."""
    micro_batch_tokens: int = Field(4096, ge=1)
    """Most tokens per forward in ``forward``/``forward_backward`` (a call's datums are
    processed in micro-batches of about this many padded tokens; the loss is a sum, so the
    gradient is the same)."""
    sample_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one ``sample`` call through the router, replica start-up included."""
    future_wait_s: float = Field(20.0, gt=0, le=40)
    """How long one ``retrieve_future`` poll waits for a result before answering "try again"
    (below the SDK's 45 s poll timeout)."""
    kept_results: int = Field(10_000, ge=100)
    """Finished requests whose answers are kept for retrieval (and for retries of the same
    request, which are answered from here instead of running twice); the oldest go first."""
