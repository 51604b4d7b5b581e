"""Typed configuration for every role, loaded from YAML with dotted overrides.

One file describes the whole fleet (each role reads the section it needs), so
``rlfleet up`` and docker compose hand the same file to every process. Precedence:
YAML file < ``RLFLEET_*`` environment variables < command-line ``a.b.c=value`` overrides.
Every field carries a docstring (shown by ``rlfleet <verb> --help-config``); cross-field
rules are checked at load time so a bad config fails before any model loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

SOURCE_ROOT = Path(__file__).resolve().parents[2]
"""The folder that holds the rlfleet package (``services/``): the repository in a source
checkout, which is where the default model (``models/``) and data (``data/``) ship."""

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def shipped_path(path: str) -> str:
    """``path`` itself when it is absolute or exists from here; else the same relative path
    under ``SOURCE_ROOT`` when it exists there. Why: the defaults are relative to the
    repository, so a role started from another directory would miss them, and transformers
    would take the missing folder for a Hub model id and report a network error."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return path
    shipped = SOURCE_ROOT / given
    return str(shipped) if shipped.exists() else path


class Section(BaseModel):
    """Base: unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModelConfig(Section):
    path: str = "models/tiny-qwen2-arith"
    """Hugging Face causal-LM directory (local; nothing is downloaded)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for the actor, reference, critic and rollout engines."""


class DataConfig(Section):
    train_files: list[str] = ["data/arith/train.jsonl"]
    """JSONL or Parquet files in verl's schema (prompt, data_source, reward_model.ground_truth)."""
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


class EndpointsConfig(Section):
    router: str = "127.0.0.1:50051"
    """Address of the router (Rollout.Generate + Router)."""
    reward: str = "127.0.0.1:50061"
    """Address of the reward service."""
    refcritic: str = "127.0.0.1:50071"
    """Address of the refcritic service."""
    trainer: str = "127.0.0.1:50081"
    """Address of the trainer's control service."""


class RolloutConfig(Section):
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """Inference engine: vLLM (AsyncLLM), the transformers ``generate`` fallback, or ``auto``
    (vLLM when a CUDA GPU is visible, else transformers; see README for the CPU numbers)."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    max_tokens: int = 8
    """Maximum new tokens per response."""
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
    kv_cache_space_gib: float = 1.0
    """vLLM CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = True
    """vLLM: skip torch.compile/CUDA graphs. On CPU compiling costs ~30 s per start and its
    cache does not reload; for small models eager is as fast. Set False on GPUs."""
    gpu_memory_utilization: float = 0.3
    """vLLM GPU memory fraction per replica (GPU only)."""
    max_model_len: int = 64
    """Longest prompt + response the engine supports."""
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
    onto the replica's stream (they are re-delivered, never lost)."""
    debug_generate_delay_s: float = 0.0
    """Chaos/testing aid: sleep this long inside every queued request before generating, so
    tests can kill a replica mid-request. Keep 0 in real runs."""
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
    max_inflight_per_replica: int = 256
    """Load cap: a sticky replica above this many in-flight requests is not reused."""
    request_timeout_s: float = 120.0
    """Default time a Generate call waits for its result."""
    route_wait_s: float = 3.0
    """How long a request waits for an eligible replica (registering, catching up on weights)
    before the router answers UNAVAILABLE."""
    janitor_interval_s: float = 1.0
    """How often the router looks for dead replicas and migrates their queued work."""
    http_port: int | None = None
    """Port of the OpenAI-compatible HTTP front (``/v1/models``, ``/v1/completions``,
    ``/v1/chat/completions``, and Prometheus ``/metrics``); None = off, 0 = any free port.
    It tokenizes chat messages with ``model.path``'s tokenizer."""
    metrics_port: int | None = None
    """Port of a ``/metrics``-only HTTP server, for routers without ``http_port`` (which
    serves ``/metrics`` itself); None = off."""


class UserScorerConfig(Section):
    path: str
    """Python file defining the function."""
    name: str = "compute_score"
    """Function name, called by keyword as verl does: ``compute_score(data_source=...,
    solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)`` (``prompt=`` too when
    it names that parameter), sync or ``async def``; or verl's batch form, taking
    ``data_sources, solution_strs, ground_truths, extra_infos`` lists and returning a list."""
    reward_kwargs: dict[str, Any] = {}
    """Extra keyword arguments passed on every call."""
    data_sources: list[str] = []
    """data_source values routed to this scorer (empty = it is the default for unknown ones)."""


class SandboxLimits(Section):
    """Limits of one sandboxed child (a user-function worker, or one run of the ``code``
    scorer). What the kernel enforces and what only a Python audit hook does is in the README
    ("Reward service")."""

    timeout_s: float = 10.0
    """Wall clock of one call (one item, or one batch-form call) or one program run; past it
    the child's whole process group is killed (a pool worker is then replaced)."""
    cpu_s: float = 10.0
    """CPU seconds per call or run (RLIMIT_CPU; SIGXCPU ends the child)."""
    memory_mb: int = 2048
    """Address space of the child (RLIMIT_AS): allocation past it raises MemoryError."""
    file_size_mb: int = 16
    """Largest file the child may write (RLIMIT_FSIZE)."""
    processes: int = 256
    """RLIMIT_NPROC (binds only for a non-root user; as root, process creation is refused by
    the audit hook and the process group is killed after every run)."""
    workers: int = 2
    """Sandboxed user-function processes per reward process, and concurrent ``code`` runs."""
    output_kb: int = 1024
    """Most stdout/stderr kept from one ``code`` run; more kills the run."""


class RewardConfig(Section):
    host: str = "127.0.0.1"
    """Interface the reward gRPC server binds to."""
    port: int = 50061
    """Reward gRPC port."""
    http_port: int | None = None
    """Port of the HTTP (FastAPI) front door; None = off."""
    workers: int = 1
    """Reward worker tasks started inside the service process."""
    custom: UserScorerConfig | None = None
    """A user scoring function (verl ``compute_score`` signature)."""
    request_timeout_s: float = 60.0
    """How long a scoring request waits for a worker."""
    local_first: bool = True
    """Score a request inside the process that received it when one of its own workers is idle
    (no Redis hop; durable because the caller retries a failed RPC); else queue it."""
    default_scorer: str = "math"
    """Scorer for HTTP callers that name no data_source (OpenRLHF ``/get_reward``, slime)."""
    composite: dict[str, float] = {"math": 0.9, "format": 0.1}
    """The ``composite`` scorer: a weighted sum of these built-in scorers' scores."""
    sandbox: bool = True
    """Run the user function (``custom``) in sandboxed child processes (``sandbox_limits``: a
    timeout, CPU, memory, file size, no network, scrubbed environment, empty cwd); false runs
    it in threads of the service (trusted code only). The ``code`` scorer is always sandboxed."""
    sandbox_limits: SandboxLimits = SandboxLimits()
    """Limits of each sandboxed process."""
    default_score: float = 0.0
    """Score of an item that could not be scored (its ``error`` says why): a raise, a timeout,
    a crash, a sandbox violation, an unknown data source."""
    code_scoring: Literal["fraction", "all"] = "fraction"
    """``code`` scorer: the fraction of tests passed, or 1.0 only when all pass."""


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


KLEstimator = Literal["k1", "k2", "k3", "low_var_kl", "kl", "mse", "abs"]
"""KL estimators (``rlfleet.rl.core_algos.kl_penalty``); ``kl``/``mse`` are verl's k1/k2."""


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: the in-reward KL coefficient stays ``kl_coef``; ``adaptive``: it is steered
    toward ``target_kl`` (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient of the KL subtracted from the reward."""
    target_kl: float = 0.1
    """Adaptive: the KL per token the controller aims for."""
    horizon: int = 10000
    """Adaptive: samples over which the coefficient may change by at most 20%."""


class OverlongBufferConfig(Section):
    enable: bool = False
    """DAPO overlong reward shaping: penalise responses that run into the last ``len`` tokens
    before ``rollout.max_tokens``, linearly down to ``-penalty_factor`` at the limit."""
    len: int = 0
    """Length of the soft-penalty zone in tokens (0 < len <= rollout.max_tokens when enabled)."""
    penalty_factor: float = 1.0
    """Penalty at the limit (added to the score, before the advantage)."""


class FilterGroupsConfig(Section):
    enable: bool = False
    """DAPO dynamic sampling: drop prompt groups whose samples all scored the same (zero
    advantage) and generate more prompts until the batch is full."""
    max_num_gen_batches: int = 10
    """Give up and train on what is there after this many generation rounds (0 = no limit)."""


class AlgorithmConfig(Section):
    adv_estimator: Literal[
        "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"
    ] = "grpo"
    """Advantage estimator; ``gae`` needs the critic, ``remax`` one greedy generation per prompt
    as its baseline, ``reinforce_plus_plus_baseline`` subtracts the group mean then whitens."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's std (False = Dr. GRPO style)."""
    gamma: float = 1.0
    """Discount (GAE / REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    use_kl_in_reward: bool = False
    """Subtract ``kl_ctrl`` * KL(actor || reference) from each token's reward (PPO/RLHF style);
    needs the reference policy. Independent of ``trainer.use_kl_loss``."""
    kl_penalty: KLEstimator = "kl"
    """KL estimator for the in-reward penalty (``kl`` = k1, verl's default)."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    """Coefficient of the in-reward KL: fixed or adaptive."""
    overlong_buffer: OverlongBufferConfig = OverlongBufferConfig()
    """DAPO's soft overlong punishment (verl: ``reward_model.overlong_buffer``)."""
    filter_groups: FilterGroupsConfig = FilterGroupsConfig()
    """DAPO's dynamic sampling (verl: ``algorithm.filter_groups``)."""


class TrainerConfig(Section):
    total_steps: int = 200
    """Training steps (one batch of prompts each)."""
    lr: float = 1e-4
    """Actor learning rate (AdamW)."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """Learning-rate schedule after warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    ppo_mini_batch_size: int = 0
    """Sequences per optimizer step (0 = the whole batch in one step)."""
    clip_ratio_low: float = 0.2
    """PPO lower clip."""
    clip_ratio_high: float = 0.2
    """PPO upper clip."""
    clip_ratio_c: float = 3.0
    """Dual-clip PPO: the loss of a negative-advantage token is capped at -A * clip_ratio_c
    (> 1), so one token whose probability exploded cannot dominate. Vanilla mode only."""
    policy_loss_mode: Literal["vanilla", "gspo"] = "vanilla"
    """``vanilla``: token-level ratio (PPO, dual clip); ``gspo``: sequence-level ratio (GSPO,
    which uses seq-mean-token-mean; the paper's clip ratios are ~3e-4 / 4e-4)."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses become one number (``seq-mean-token-sum-norm``: Dr. GRPO, the sum
    over tokens divided by ``rollout.max_tokens``)."""
    use_kl_loss: bool = True
    """Add a KL(actor || reference) term to the loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: KLEstimator = "low_var_kl"
    """KL estimator."""
    entropy_coeff: float = 0.0
    """Entropy bonus weight."""
    grad_clip: float = 1.0
    """Max gradient norm."""
    save_freq: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    val_before_train: bool = True
    """Measure held-out accuracy before training."""
    host: str = "127.0.0.1"
    """Trainer control server interface."""
    port: int = 50081
    """Trainer control gRPC port."""
    seed: int = 0
    """Torch seed."""
    torch_threads: int = 1
    """Intra-op threads for the trainer's torch."""
    resume_from: str | None = None
    """Checkpoint directory written by this trainer (``run_dir/checkpoints/global_step_N`` or
    ``final``) to continue from: actor weights, optimizer, schedule, step and data position.
    The reference policy stays ``model.path``."""
    resume_mode: str = "auto"
    """``auto``: continue from the newest ``run_dir/checkpoints/global_step_N`` if there is one;
    ``disable``: always start fresh; any other value: that checkpoint directory (verl's
    ``trainer.resume_mode``). ``resume_from``, when set, wins."""
    max_ckpt_to_keep: int = 0
    """Keep only the newest N ``global_step_N`` checkpoints (0 = keep all)."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: generate with the weights being trained (strictly on-policy). ``async``:
    replicas generate the next batches while the trainer updates; see ``max_staleness``."""
    max_staleness: int = 1
    """Async mode: the oldest weight version a trained response may come from is
    ``current - max_staleness``; older ones are dropped (counted in ``async/dropped``)."""
    old_logprob_source: Literal["engine", "actor"] = "engine"
    """Where the PPO ratio's old log-probs come from when a batch takes several optimizer
    steps: ``engine`` (the sampling engine's own, no extra forward; in async mode the ratio is
    then against the behaviour policy) or ``actor`` (a forward of the actor before the update;
    in async mode the proximal policy of AReaL's decoupled objective, with truncated
    importance weights for stale responses)."""
    is_cap: float = 2.0
    """Async mode: cap of the per-token importance weight pi_prox / pi_behav."""
    test_freq: int = 0
    """Validate (greedy accuracy on the held-out set) every N steps; 0 = only before/after."""
    target_accuracy: float = 0.85
    """Held-out accuracy whose first crossing is reported as ``time_to_<target>_s`` (training
    clock, validation excluded)."""
    min_replicas: int = 1
    """Rollout replicas that must be serving before training starts (``rlfleet up`` sets N)."""
    replica_wait_s: float = 600.0
    """How long to wait for ``min_replicas`` at start-up before failing."""
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"]] = [
        "console",
        "jsonl",
    ]
    """Where step metrics go: ``console`` (a line per step), ``jsonl`` (run_dir/metrics.jsonl),
    ``tensorboard`` (run_dir/tensorboard), ``wandb`` (offline, run_dir/wandb; sync later with
    ``wandb sync``), ``mlflow`` (file store run_dir/mlruns). The last three need the
    ``loggers`` extra."""
    project_name: str = "rlfleet"
    """Project (W&B project, MLflow experiment) the run is filed under."""
    experiment_name: str | None = None
    """Name of this run in W&B/MLflow/TensorBoard; None = the name of ``run_dir``."""


class RlfleetConfig(Section):
    cluster: str = "default"
    """Namespace for Redis keys (rlfleet:{cluster}:...), so runs can share a server."""
    redis_url: str | None = None
    """Redis URL; None = ``rlfleet up`` starts an embedded Valkey."""
    api_key: str | None = None
    """If set, every RPC must carry ``authorization: Bearer <key>`` (health checks excepted)."""
    run_dir: str = "runs/default"
    """Where logs, metrics.jsonl, plots and checkpoints go."""
    log_level: LogLevel = "INFO"
    """Logging level for every role: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)."""
    max_message_mb: int = 64
    """gRPC send/receive message size limit (weights travel in chunks below this)."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    endpoints: EndpointsConfig = EndpointsConfig()
    rollout: RolloutConfig = RolloutConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    refcritic: RefCriticConfig = RefCriticConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_capitals(cls, level: Any) -> Any:
        """``debug`` works like ``DEBUG``; a misspelt level is an error, not silently INFO."""
        return level.upper() if isinstance(level, str) else level

    @model_validator(mode="after")
    def _find_shipped_files(self) -> RlfleetConfig:
        """Relative model and data paths missing from the working directory are looked up
        where the package ships them (see ``shipped_path``)."""
        self.model.path = shipped_path(self.model.path)
        self.data.train_files = [shipped_path(f) for f in self.data.train_files]
        self.data.val_files = [shipped_path(f) for f in self.data.val_files]
        return self

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RlfleetConfig:
        if self.rollout.n < 1:
            raise ValueError("rollout.n must be >= 1")
        if self.algorithm.adv_estimator in ("grpo", "rloo") and self.rollout.n < 2:
            raise ValueError(f"{self.algorithm.adv_estimator} needs rollout.n >= 2 (a group)")
        if self.data.train_batch_size < 1 or self.trainer.total_steps < 0:
            raise ValueError("data.train_batch_size must be >= 1 and trainer.total_steps >= 0")
        mini = self.trainer.ppo_mini_batch_size
        batch = self.data.train_batch_size * self.rollout.n
        if mini and batch % mini:
            raise ValueError(f"trainer.ppo_mini_batch_size={mini} must divide {batch} sequences")
        if self.data.max_prompt_length + self.rollout.max_tokens > self.rollout.max_model_len:
            raise ValueError("data.max_prompt_length + rollout.max_tokens > rollout.max_model_len")
        if self.trainer.max_staleness < 0 or self.trainer.is_cap <= 0:
            raise ValueError("trainer.max_staleness must be >= 0 and trainer.is_cap > 0")
        self._check_algorithm()
        return self

    def _check_algorithm(self) -> None:
        """Rules of the verl algorithm knobs (dual clip, KL controller, overlong buffer)."""
        if self.trainer.clip_ratio_c <= 1.0:
            raise ValueError(f"trainer.clip_ratio_c must be > 1, got {self.trainer.clip_ratio_c}")
        ctrl = self.algorithm.kl_ctrl
        if ctrl.type == "adaptive" and (ctrl.target_kl <= 0 or ctrl.horizon <= 0):
            raise ValueError("algorithm.kl_ctrl: adaptive needs target_kl > 0 and horizon > 0")
        buffer = self.algorithm.overlong_buffer
        if buffer.enable and not 0 < buffer.len <= self.rollout.max_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer.len={buffer.len} must be in "
                f"(0, rollout.max_tokens={self.rollout.max_tokens}] when enabled"
            )

    @property
    def needs_reference(self) -> bool:
        """The loss or the reward has a KL term, so reference log-probs are computed every step."""
        kl_loss = self.trainer.use_kl_loss and self.trainer.kl_loss_coef > 0
        return kl_loss or self.algorithm.use_kl_in_reward

    @property
    def needs_critic(self) -> bool:
        """The advantage estimator reads critic values (GAE)."""
        return self.algorithm.adv_estimator == "gae"

    @property
    def needs_refcritic(self) -> bool:
        """Whether the refcritic service has to run at all."""
        return self.needs_reference or self.needs_critic


ENV_OVERRIDES = {
    "RLFLEET_REDIS_URL": "redis_url",
    "RLFLEET_CLUSTER": "cluster",
    "RLFLEET_API_KEY": "api_key",
    "RLFLEET_RUN_DIR": "run_dir",
    "RLFLEET_MODEL_PATH": "model.path",
    "RLFLEET_ROLLOUT_BACKEND": "rollout.backend",
    "RLFLEET_ROUTER_ADDR": "endpoints.router",
    "RLFLEET_REWARD_ADDR": "endpoints.reward",
    "RLFLEET_REFCRITIC_ADDR": "endpoints.refcritic",
    "RLFLEET_TRAINER_ADDR": "endpoints.trainer",
    "RLFLEET_ADVERTISE_HOST": "rollout.advertise_host",
}


def parse_value(text: str) -> Any:
    """Read an override value as YAML (``3``, ``true``, ``[a, b]``, ``null``) or a plain string."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree["a"]["b"]["c"] = value`` for ``dotted = "a.b.c"``, creating dicts."""
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {part!r} is not a section")
    node[leaf] = value


def split_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like section.field=value")
    key, _, raw = item.partition("=")
    return key.strip(), parse_value(raw)


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> RlfleetConfig:
    """Load YAML, apply ``RLFLEET_*`` variables, then dotted overrides, and validate."""
    tree: dict = {}
    if path is not None:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    env = os.environ if env is None else env
    for var, dotted in ENV_OVERRIDES.items():
        if env.get(var):
            set_dotted(tree, dotted, env[var])
    for item in overrides or []:
        set_dotted(tree, *split_override(item))
    return RlfleetConfig.model_validate(tree)


def describe_fields(model: type[BaseModel] = RlfleetConfig, prefix: str = "") -> list[str]:
    """``dotted.name = default: docstring`` for every field, for --help-config. Sections are
    spelled out field by field, optional ones (``reward.custom``) included."""
    lines = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        section = _section_of(field.annotation)
        if section is None or field.description:
            default = "(required)" if field.is_required() else f"= {field.default!r}"
            lines.append(f"{dotted} {default}: {field.description or ''}")
        if section is not None:
            lines.extend(describe_fields(section, f"{dotted}."))
    return lines


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds, also behind ``| None``; None for plain values."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
