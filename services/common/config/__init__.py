"""Typed configuration for every role, loaded from YAML with dotted overrides.

One file describes the whole fleet (each role reads the section it needs), so ``rlfleet up``
and docker compose hand the same file to every process. Precedence: YAML file <
``RLFLEET_*`` environment variables < command-line ``a.b.c=value`` overrides. Every field
carries a docstring (shown by ``rlfleet <verb> --help-config``); cross-field rules are checked
at load time so a bad config fails before any model loads.

Modules: ``base`` (Section, shipped paths), ``serving`` (model, data, endpoints, rollout,
router, refcritic), ``reward`` (reward, its scorers and sandbox), ``training`` (algorithm,
trainer), ``root`` (RlfleetConfig and its cross-field rules), ``loading`` (YAML, environment,
overrides, ``--help-config``).
"""

from rlfleet.common.config.base import (
    SOURCE_ROOT,
    LogLevel,
    Section,
    shipped_path,
)
from rlfleet.common.config.loading import (
    ENV_OVERRIDES,
    describe_fields,
    load_config,
    parse_value,
    set_dotted,
    split_override,
)
from rlfleet.common.config.reward import (
    JudgeConfig,
    RewardConfig,
    RewardModelConfig,
    SandboxLimits,
    UserScorerConfig,
)
from rlfleet.common.config.root import RlfleetConfig
from rlfleet.common.config.serving import (
    DataConfig,
    EndpointsConfig,
    ModelConfig,
    RefCriticConfig,
    RolloutConfig,
    RouterConfig,
)
from rlfleet.common.config.training import (
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    KLEstimator,
    OverlongBufferConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "DataConfig",
    "ENV_OVERRIDES",
    "EndpointsConfig",
    "FilterGroupsConfig",
    "JudgeConfig",
    "KLControlConfig",
    "KLEstimator",
    "LogLevel",
    "ModelConfig",
    "OverlongBufferConfig",
    "RefCriticConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RlfleetConfig",
    "RolloutConfig",
    "RouterConfig",
    "SOURCE_ROOT",
    "SandboxLimits",
    "Section",
    "TrainerConfig",
    "UserScorerConfig",
    "describe_fields",
    "load_config",
    "parse_value",
    "set_dotted",
    "shipped_path",
    "split_override",
]
