"""The whole fleet's config: every section, plus the cross-field rules checked at load."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import parse_qs, quote, unquote, urlsplit

from pydantic import field_validator, model_validator

from rlfleet.common.config.agent import AgentConfig
from rlfleet.common.config.base import LogLevel, Section, shipped_path
from rlfleet.common.config.dashboard import DashboardConfig
from rlfleet.common.config.ray import RayConfig
from rlfleet.common.config.reward import RewardConfig
from rlfleet.common.config.security import TlsConfig
from rlfleet.common.config.serving import (
    DataConfig,
    EndpointsConfig,
    ModelConfig,
    RefCriticConfig,
    RolloutConfig,
    RouterConfig,
)
from rlfleet.common.config.tinker import TinkerConfig
from rlfleet.common.config.training import (
    AlgorithmConfig,
    TrainerConfig,
)


class RlfleetConfig(Section):
    cluster: str = "default"
    """Namespace for Redis keys (rlfleet:{cluster}:...), so runs can share a server."""
    redis_url: str | None = None
    """Redis URL; None = ``rlfleet up`` starts an embedded Valkey. ``rediss://`` speaks TLS,
    trusting ``tls.ca_file`` and presenting ``tls.cert_file`` (for a Redis started with
    ``tls-auth-clients yes``); ``redis://:PASSWORD@host:port/0`` carries a password."""
    redis_password: str | None = None
    """Password Redis requires (``AUTH``), set into ``redis_url`` when that carries none
    (``RLFLEET_REDIS_PASSWORD``); the embedded server ``rlfleet up`` starts requires it too.
    Like ``api_key`` and ``redis_url`` it never goes on a role's command line, and the recorded
    config masks it."""
    api_key: str | None = None
    """If set, every RPC must carry ``authorization: Bearer <key>`` (health checks excepted)."""
    run_dir: str = "runs/default"
    """Where logs, metrics.jsonl, plots and checkpoints go."""
    log_level: LogLevel = "INFO"
    """Logging level for every role: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case)."""
    max_message_mb: int = 64
    """gRPC send/receive message size limit (weights travel in chunks below this)."""
    tls: TlsConfig = TlsConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    endpoints: EndpointsConfig = EndpointsConfig()
    rollout: RolloutConfig = RolloutConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    refcritic: RefCriticConfig = RefCriticConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    launcher: Literal["local", "ray"] = "local"
    """What ``rlfleet up`` runs the roles as: local processes, or Ray actors (``--ray``)."""
    ray: RayConfig = RayConfig()
    dashboard: DashboardConfig = DashboardConfig()
    agent: AgentConfig = AgentConfig()
    tinker: TinkerConfig = TinkerConfig()

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
    def _password_into_url(self) -> RlfleetConfig:
        """``redis_password`` goes into ``redis_url``, so every client of the URL sends it."""
        if self.redis_url and self.redis_password:
            self.redis_url = with_password(self.redis_url, self.redis_password)
        return self

    def require_redis_url(self) -> str:
        """``redis_url`` for what cannot run without Redis; ValueError saying how to set it."""
        if not self.redis_url:
            raise ValueError("no Redis to reach: set redis_url=... or RLFLEET_REDIS_URL")
        return self.redis_url

    @model_validator(mode="after")
    def _check_cross_fields(self) -> RlfleetConfig:
        if self.rollout.n < 1:
            raise ValueError("rollout.n must be >= 1")
        grouped = self.algorithm.adv_estimator in ("grpo", "rloo")
        if grouped and self.rollout.n < 2 and self.trainer.mode != "sft":
            raise ValueError(f"{self.algorithm.adv_estimator} needs rollout.n >= 2 (a group)")
        if self.data.train_batch_size < 1 or self.trainer.total_steps < 0:
            raise ValueError("data.train_batch_size must be >= 1 and trainer.total_steps >= 0")
        self._check_batch_sizes()
        if self.data.max_prompt_length + self.rollout.max_tokens > self.rollout.max_model_len:
            raise ValueError("data.max_prompt_length + rollout.max_tokens > rollout.max_model_len")
        if self.trainer.max_staleness < 0 or self.trainer.is_cap <= 0:
            raise ValueError("trainer.max_staleness must be >= 0 and trainer.is_cap > 0")
        self._check_algorithm()
        self.agent.check_model_len(self.rollout.max_model_len)
        self._check_agent_mode()
        self._check_sft_mode()
        self._check_deterministic()
        if self.tinker.enabled and not self.model.lora_rank:
            raise ValueError("tinker.enabled needs model.lora_rank > 0 (the largest rank served)")
        if self.model.lora_rank and self.trainer.strategy != "single":
            raise NotImplementedError(
                "model.lora_rank with trainer.strategy ddp/fsdp is not built yet; use single"
            )
        return self

    def _check_batch_sizes(self) -> None:
        """A mini-batch divides the batch; a micro-batch is a part of a mini-batch."""
        mini = self.trainer.ppo_mini_batch_size
        batch = self.data.train_batch_size * self.rollout.n
        # A mini-batch as large as the batch (or larger) is one update on the whole batch.
        if mini and mini < batch and batch % mini:
            raise ValueError(f"trainer.ppo_mini_batch_size={mini} must divide {batch} sequences")
        micro, rows = self.trainer.ppo_micro_batch_size, min(mini or batch, batch)
        if micro > rows:
            raise ValueError(
                f"trainer.ppo_micro_batch_size={micro} must be 0 (the whole mini-batch) or at "
                f"most the {rows} sequences of a mini-batch (trainer.ppo_mini_batch_size, "
                "data.train_batch_size x rollout.n)"
            )

    def _check_agent_mode(self) -> None:
        """What agent mode (multi-turn episodes) does not train yet, refused at load."""
        if not self.agent.env:
            return
        unsupported = {
            "algorithm.adv_estimator=gae (a critic over masked turns)": self.needs_critic,
            "algorithm.adv_estimator=remax (greedy baseline episodes)": (
                self.algorithm.adv_estimator == "remax"
            ),
            "trainer.val_n > 1 (sampled validation episodes)": self.trainer.val_n > 1,
            "algorithm.overlong_buffer (per-turn lengths)": self.algorithm.overlong_buffer.enable,
            "data.pass_rate_sampling (episode scores)": self.data.pass_rate_sampling.enable,
        }
        named = [name for name, used in unsupported.items() if used]
        if named:
            raise NotImplementedError(f"agent mode does not support {', '.join(named)} yet")

    def _check_sft_mode(self) -> None:
        """What ``trainer.mode: sft`` and the SFT warm-up do not run yet, refused at load."""
        if self.trainer.sft_warmup_steps:
            self._check_sft_warmup()
        elif self.trainer.sft_warmup_lr is not None:
            raise ValueError("trainer.sft_warmup_lr is the rate of trainer.sft_warmup_steps (0)")
        if self.trainer.mode != "sft":
            return
        if self.data.pass_rate_sampling.enable:
            raise ValueError("data.pass_rate_sampling draws RL prompts; trainer.mode=sft has none")
        if self.agent.env:
            raise NotImplementedError("trainer.mode=sft with agent.env (episodes) is not built")
        if self.trainer.strategy != "single":
            raise NotImplementedError(
                "trainer.mode=sft with trainer.strategy ddp/fsdp is not built yet; use single"
            )

    def _check_sft_warmup(self) -> None:
        trainer = self.trainer
        if trainer.mode == "sft":
            raise ValueError("trainer.sft_warmup_steps is for RL runs; trainer.mode=sft is all SFT")
        if not self.data.sft_files:
            raise ValueError("trainer.sft_warmup_steps needs data.sft_files (the demonstrations)")
        if trainer.sft_warmup_steps >= trainer.total_steps:
            raise ValueError(
                f"trainer.sft_warmup_steps={trainer.sft_warmup_steps} leaves no RL step of "
                f"trainer.total_steps={trainer.total_steps}"
            )
        if self.agent.env or trainer.strategy != "single":
            raise NotImplementedError(
                "trainer.sft_warmup_steps with agent.env or ddp/fsdp is not built yet"
            )

    def _check_deterministic(self) -> None:
        """``trainer.deterministic`` promises equal runs only where they can be equal (docs/
        algorithms.md, "Reproducible runs"); ``rollout.backend: auto`` becomes ``hf``."""
        if not self.trainer.deterministic:
            return
        if self.trainer.mode == "async":
            raise ValueError(
                "trainer.deterministic needs trainer.mode=sync: in async mode the weight version "
                "each sample is generated with depends on timing"
            )
        if self.rollout.backend == "vllm":
            raise ValueError(
                "trainer.deterministic needs rollout.backend=hf: a vLLM replica's logits depend "
                "on how it batches requests (its batch-invariant mode is GPU-only)"
            )
        if self.agent.env or self.trainer.strategy != "single":
            raise NotImplementedError(
                "trainer.deterministic with agent.env or trainer.strategy ddp/fsdp is not built"
            )
        self.rollout.backend = "hf"

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
        if self.trainer.mode == "sft":  # cross-entropy only: no KL, no reference
            return False
        kl_loss = self.trainer.use_kl_loss and self.trainer.kl_loss_coef > 0
        return kl_loss or self.algorithm.use_kl_in_reward

    @property
    def needs_critic(self) -> bool:
        """The advantage estimator reads critic values (GAE) and RL steps run."""
        return self.algorithm.adv_estimator == "gae" and self.trainer.mode != "sft"

    @property
    def reference_from_actor(self) -> bool:
        """Reference log-probs come from the trainer's own model with the LoRA adapter switched
        off (the base is the reference; no second copy of it anywhere)."""
        return self.needs_reference and self.model.lora_rank > 0

    @property
    def needs_refcritic(self) -> bool:
        """Whether the refcritic service has to run at all."""
        return (self.needs_reference and not self.reference_from_actor) or self.needs_critic


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in it (percent-encoded; a ``unix://`` socket's as the query's
    ``password``); refused when it holds another."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        given = parse_qs(parts.query).get("password")
        if given and given[0] != password:
            raise ValueError("redis_password differs from the password in redis_url: set one")
        query = "&".join(filter(None, [parts.query, f"password={quote(password, safe='')}"]))
        return url if given else f"{url.partition('?')[0]}?{query}"  # geturl() drops "//"
    if parts.password is not None:
        if unquote(parts.password) != password:
            raise ValueError("redis_password differs from the password in redis_url: set one")
        return url
    user, host = parts.username or "", parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}").geturl()
