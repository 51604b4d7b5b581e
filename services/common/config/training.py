"""Config sections of training: the algorithm (advantages, KL, DAPO) and the trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlfleet.common.config.base import Section
from rlfleet.common.config.health import HealthConfig
from rlfleet.common.config.rollout_correction import RolloutCorrectionConfig
from rlfleet.common.config.weight_check import WeightCheckConfig

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
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    """verl's rollout correction (importance weights, IcePop, rejection, bypass mode) for the
    engine-vs-trainer mismatch; off by default, when ``trainer.is_cap`` is the correction."""


class TrainerConfig(Section):
    total_steps: int = 200
    """Training steps (one batch of prompts each)."""
    max_training_s: float = Field(0.0, ge=0)
    """Stop after the step in which the training clock (validation excluded) passed this many
    seconds, even before ``total_steps``: a budget of time, as a wall-clock comparison with a
    peer gives each side; 0 = no limit. The final validation still runs."""
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
    """Sequences per optimizer step (0, or as many as the batch holds or more = the whole batch
    in one step)."""
    ppo_micro_batch_size: int = Field(0, ge=0)
    """Sequences per forward and backward inside a mini-batch (verl's
    ``ppo_micro_batch_size_per_gpu``; 0 = the whole mini-batch at once). The gradients of the
    micro-batches add up to the mini-batch's (each loss weighted by its share of the
    aggregation's denominator), so this bounds the trainer's memory (the ``[rows, tokens,
    vocab]`` logits and their backward) without changing the update; the actor's no-grad
    log-prob forwards take as many rows at a time. Data-parallel actors split each rank's shard
    so (per rank). At most the rows of a mini-batch."""
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
    """The run's seed: torch's (the PPO epochs' row order); with ``deterministic`` also Python's,
    numpy's and every sampling request's. The data order is ``data.seed``'s."""
    torch_threads: int = 1
    """Intra-op threads for the trainer's torch."""
    malloc_mmap_threshold_kb: int = Field(64, ge=0)
    """glibc malloc serves blocks of at least this many KiB from mappings of their own, given
    back to the system when freed (``mallopt(M_MMAP_THRESHOLD)``, set by the trainer at
    start-up, so under any launcher); 0 leaves malloc as the environment set it. Without it,
    freed activations of each micro-batch stay in malloc's heaps and the peak grows step after
    step: on the SmolLM2 recipe's update (micro-batches of 8) 5.21 GiB at 1 MiB, 4.68 at 64
    KiB (an update-only probe on bench_trainer_memory.py's batches; docs/real_model.md)."""
    onednn_cache_capacity: int = Field(16, ge=0)
    """Compiled oneDNN kernels the trainer keeps (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, unless
    the environment sets it; 0 = oneDNN's default of 1,024). bf16 matmuls on CPU compile a
    kernel per shape, 256-512 KiB each, and micro-batches change shape every step: the default
    cache grew the SmolLM2 recipe's trainer by 0.53 GiB over 80 steps (``rlfleet.model.heap``)."""
    deterministic: bool = False
    """Reproducible runs: two runs of one config with the same ``seed`` write the same
    ``metrics.jsonl`` (timing columns aside). Every sampling request, training and
    validation, carries a seed derived from ``seed``, the step and the prompt's position
    (``rlfleet.trainer.determinism.request_seed``), so the HF engine samples it alone, whatever
    else is queued; the trainer seeds torch, Python and numpy and runs
    ``torch.use_deterministic_algorithms``. Sync mode with the HF engine only (``auto`` means
    ``hf`` here); async mode and vLLM are refused, and why is in docs/algorithms.md,
    "Reproducible runs". Costs the batching of requests across prompts."""
    autocast_dtype: Literal["none", "bfloat16", "auto"] = "none"
    """``bfloat16``: the actor's forwards and backward run under ``torch.autocast`` in bf16
    (weights, optimizer and the loss stay fp32; the logits are cast back to fp32 before the
    log-softmax). On a CPU with AMX or AVX-512 BF16 the matmuls run faster (1.6x measured);
    on one without, bf16 is emulated and 2-3x slower. ``auto``: bf16 on a GPU or such a CPU,
    else none (``rlfleet.model.precision``). ``none`` keeps every op in the model's dtype."""
    share_prompt_forward: bool = True
    """Run each distinct prompt of a mini-batch through the actor once and its rows' responses
    on top of its KV cache (exact: the same log-probs and gradients as one forward per row, for
    fewer tokens; a GRPO group of n samples shares one prompt). ``false``: one forward over every
    (prompt, response) row. Data-parallel actors always take the single forward."""
    strategy: Literal["single", "ddp", "fsdp"] = "single"
    """How the actor trains: ``single`` (in the trainer process), ``ddp`` (forward and backward
    data-parallel on ``world_size`` Ray workers with torch DistributedDataParallel: gloo on CPU,
    NCCL on GPU; weights pushed from rank 0) or ``fsdp`` (the same workers with the model and
    its optimizer state sharded by FSDP2 ``fully_shard``, one unit per decoder layer; float32;
    the full weights gathered for each push and checkpoint)."""
    world_size: int = Field(1, ge=1)
    """Data-parallel workers (ranks) of the ``ddp``/``fsdp`` actor, one placement-group bundle
    each; the rows of every mini-batch are split between them. Must be 1 with ``strategy:
    single``."""
    worker_gpus: float = Field(0.0, ge=0)
    """GPUs per data-parallel worker (0 = CPU and gloo; 1 = one GPU each and NCCL)."""
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
    mode: Literal["sync", "async", "sft"] = "sync"
    """``sync``: generate with the weights being trained (strictly on-policy). ``async``:
    replicas generate the next batches while the trainer updates; see ``max_staleness``.
    ``sft``: supervised fine-tuning on the assistant turns of ``data.train_files``'
    conversations (``rlfleet.trainer.sft``: a warm-up on an answer format before RL), with the
    same checkpoints, weight pushes and held-out validation through the fleet; no rollouts,
    rewards, reference or critic during the steps."""
    sft_warmup_steps: int = Field(0, ge=0)
    """Sync or async mode: this many supervised steps (``mode: sft``'s update, on
    ``data.sft_files``, ``data.sft_batch_size`` conversations each) before the first RL step,
    in the same run: they count in ``total_steps``, the training clock and the metrics
    (``sft/*``), each pushes its weights, and validation at ``test_freq`` sees them. 0 = none.
    Why: a model that rarely writes the answer format gets little reward to learn from, and a
    few steps on demonstrations fix the format faster than RL finds it."""
    sft_warmup_lr: float | None = Field(None, gt=0)
    """The learning rate of the ``sft_warmup_steps`` (None: ``lr``). Supervised steps on
    demonstrations take a larger rate than RL updates do (SFT of small models is commonly run at
    1e-5 to 1e-4; RL at 1e-6 to 1e-5), and a short warm-up must teach the format, its stop
    included, in few steps. The optimizer's state carries over to the RL steps."""
    max_staleness: int = 1
    """Async mode: the oldest weight version a trained response may come from is
    ``current - max_staleness``; older ones are dropped (counted in ``async/dropped``)."""
    max_in_flight_lag: int = Field(-1, ge=-1)
    """Async mode: the most weight versions that may land while one sample is generated (its
    newest token's version - its oldest's; a request an update crossed with
    ``rollout.update_policy: keep``); a sample over it is dropped or its older tokens masked
    (``stale_tokens``), counted in ``off_policy/dropped``. -1 = bounded by ``max_staleness``
    only. Reported as ``off_policy/in_flight/{mean,max}``."""
    max_in_queue_lag: int = Field(-1, ge=-1)
    """Async mode: the most versions the trainer may publish between a sample's last token and
    the step that trains it (trainer version - its newest token's version); a sample over it
    is dropped, counted in ``off_policy/dropped``. -1 = bounded by ``max_staleness`` only.
    Reported as ``off_policy/in_queue/{mean,max}``."""
    stale_tokens: Literal["drop_sample", "mask"] = "drop_sample"
    """Async mode, per token (staleness = trainer version - the version that sampled the
    token): ``drop_sample`` drops a row holding any token older than ``max_staleness``
    (``async/dropped``); ``mask`` keeps the row and leaves only its too-old tokens out of the
    loss (``async/masked_tokens``), dropping a row only when none of its tokens is left."""
    mask_pre_update_segments: bool = False
    """Async mode: leave out of the loss every token a row sampled before the newest weight
    version in that row (slime's choice: only the segment after the last in-flight update is
    trained on); counted in ``async/masked_tokens``."""
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
    val_n: int = Field(1, ge=1)
    """Samples per held-out prompt (verl: ``rollout.val_kwargs.n``). Above 1, validation adds a
    sampled pass at ``val_temperature`` reporting ``val-core/<data_source>/reward/mean@n``,
    ``best@n`` and ``maj@n`` next to the greedy ``mean@1``."""
    val_temperature: float = Field(1.0, gt=0)
    """Sampling temperature of that pass (verl: ``rollout.val_kwargs.temperature``)."""
    log_val_generations: int = Field(4, ge=0)
    """Greedy validation samples (prompt, response, ground truth, score) logged as a table per
    validation (verl's name): ``val_samples.jsonl``, TensorBoard text, a W&B table, an MLflow
    artifact, whichever loggers are on; 0 = none."""
    target_accuracy: float = 0.85
    """Held-out accuracy whose first crossing is reported as ``time_to_<target>_s`` (training
    clock, validation excluded)."""
    min_replicas: int = 1
    """Rollout replicas that must be serving before training starts (``rlfleet up`` sets N)."""
    replica_wait_s: float = 600.0
    """How long to wait for ``min_replicas`` at start-up before failing."""
    step_retry_s: float = 120.0
    """A step whose rollout (generate, score, reference) or weight push fails with a transient
    error (UNAVAILABLE, a deadline: a Redis outage, a restarting service) is retried with the
    same request ids, with backoff, for up to this long before the run fails; 0 = never."""
    weight_shared_memory: bool = True
    """Weight pushes to replicas on the trainer's machine go through one ``/dev/shm`` file
    (the header still travels over ``Rollout.UpdateWeights``) instead of streaming the bytes
    to each; replicas that cannot see the file (other machines, containers with their own
    ``/dev/shm``) get the bytes streamed. False: always stream."""
    weight_transport: Literal["auto", "shm", "stream", "relay", "broadcast"] = "auto"
    """How the weight bytes of a push reach the replicas (the control part, the header with
    version, manifest and checksum, always goes over ``Rollout.UpdateWeights``). ``auto``: as
    ``shm`` (a relay did not beat shared memory on one host; docs/weight_delta.md). ``shm``: one
    ``/dev/shm`` file for replicas on the trainer's machine (``weight_shared_memory``), the bytes
    streamed over gRPC to the others. ``stream``: streamed to every replica. ``relay``: streamed
    to ``relay_fanout`` replicas, each forwarding the chunks as they arrive to up to
    ``relay_fanout`` others (a tree), so the trainer's link carries the model ``relay_fanout``
    times, not once per replica; each replica verifies the checksum before applying, and one a
    failed parent did not reach is pushed to straight (``weight/relay_fallbacks``).
    ``broadcast``: one collective of the flat payload on a ``torch.distributed`` group the
    trainer owns as rank 0 (gloo on CPU; nccl where the trainer has CUDA, not run yet), rebuilt
    when its members change; element deltas are streamed; a member the group did not deliver
    (not ready within ``weight_broadcast_timeout_s``, dead, refused) is streamed the full push
    (``weight/broadcast_fallbacks``)."""
    relay_fanout: int = Field(2, ge=1)
    """``weight_transport: relay``: replicas the trainer streams to, and the most each replica
    forwards to."""
    weight_broadcast_timeout_s: float = Field(30.0, gt=0)
    """``weight_transport: broadcast``: how long members have to get ready for a push (then
    the round is aborted and streamed), to open a new group, and for the collective itself
    (then the members it missed are streamed); each step, not in total."""
    weight_delta: Literal["never", "auto", "always"] = "auto"
    """Send a replica that serves the previous push's version only the elements that changed
    since, as index + value pairs (``rlfleet.model.weights_delta``; compared by their bits in
    the pushed dtype; checked against the full weights' checksum, refused by a replica on
    another version, which then gets the full push). ``auto``: only to replicas the bytes are
    streamed to (not those reading the trainer's shared-memory file, which take the full push
    faster) and only when the delta is at most a quarter of the full push; ``always``: to every
    replica on the base, whatever its size; ``never``: always full. Replicas keep their last
    full weights as the base (one more copy in host memory) unless it is ``never`` (the names
    are not on/off: YAML reads those as booleans). ``auto`` by default: on SmolLM2 pushed in
    bf16 a step changes ~0.4% of the elements (delta 1% of the bytes) and a streamed delta
    push took 0.3-0.44x the full streamed push, end to end (docs/weight_delta.md)."""
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
    health: HealthConfig = HealthConfig()
    """Run-health rules over the step metrics (``rlfleet.trainer.health``): their thresholds."""
    weight_check: WeightCheckConfig = WeightCheckConfig()
    """The parity probe after each weight push (``rlfleet.trainer.weight_check``)."""

    @model_validator(mode="after")
    def _check_parallelism(self) -> TrainerConfig:
        """One process means one rank; a GPU share only makes sense for the Ray workers."""
        if self.strategy == "single" and (self.world_size != 1 or self.worker_gpus):
            raise ValueError(
                "trainer.world_size > 1 and trainer.worker_gpus need trainer.strategy: ddp or fsdp "
                f"(got world_size={self.world_size}, worker_gpus={self.worker_gpus})"
            )
        if 0 < self.worker_gpus < 1:
            raise ValueError("trainer.worker_gpus must be 0 or >= 1: NCCL ranks cannot share a GPU")
        if self.weight_check.enable and self.strategy != "single":
            raise ValueError("trainer.weight_check needs trainer.strategy: single (for now)")
        return self

    @model_validator(mode="after")
    def _check_weight_transport(self) -> TrainerConfig:
        if self.weight_transport == "shm" and not self.weight_shared_memory:
            raise ValueError("trainer.weight_transport: shm needs trainer.weight_shared_memory")
        return self
