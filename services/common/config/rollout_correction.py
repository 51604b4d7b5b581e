"""``algorithm.rollout_correction``: verl's rollout correction, under verl's names and shapes.

Why a section of its own: the sampling engine and the trainer disagree on log-probs (another
kernel, another precision, weights a version or two old), and the suite that corrects for it
(importance weights, IcePop bounds, rejection by k1/k3 divergence, a bypass mode) has its
own knobs and presets. The threshold grammar (``"lower_upper"`` strings, one spec per
rejection option) is parsed here, without torch, so a bad spec fails at load; the maths is
``rlfleet.rl.rollout_correction``. Off by default: the trainer then keeps its own truncated
IS (``trainer.is_cap``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from rlfleet.common.config.base import Section

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""Rejection criteria verl names: token, sequence sum, sequence mean or sequence max of a
per-token divergence k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r (r = pi_train /
pi_rollout)."""

_GEO = "0.999_1.001"
PRESETS: dict[str, dict[str, Any]] = {
    "disabled": {},
    "decoupled_token_is": {"rollout_is": "token", "rollout_is_threshold": 2.0},
    "decoupled_seq_is": {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    "decoupled_token_icepop": {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
    "decoupled_seq_is_rs": {
        "rollout_is": "sequence",
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "0.5_2.0",
    },
    "decoupled_geo_rs": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": _GEO},
    "decoupled_geo_rs_seq_tis": {
        "rollout_is": "sequence",
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": _GEO,
    },
    "decoupled_geo_rs_token_tis": {
        "rollout_is": "token",
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": _GEO,
    },
    "decoupled_k3_rs": {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01},
    "decoupled_k3_rs_seq_tis": {
        "rollout_is": "sequence",
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
    "decoupled_k3_rs_token_tis": {
        "rollout_is": "token",
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
    "bypass_ppo_clip": {"bypass_mode": True},
    "bypass_ppo_clip_geo_rs": {
        "bypass_mode": True,
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": _GEO,
    },
    "bypass_ppo_clip_k3_rs": {
        "bypass_mode": True,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.01,
    },
    "bypass_pg_is": {"bypass_mode": True, "loss_type": "reinforce", "rollout_is": "sequence"},
    "bypass_pg_token_icepop": {
        "bypass_mode": True,
        "loss_type": "reinforce",
        "rollout_is": "token",
        "rollout_is_threshold": "0.5_5.0",
    },
    "bypass_pg_geo_rs": {
        "bypass_mode": True,
        "loss_type": "reinforce",
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": _GEO,
    },
    "bypass_pg_geo_rs_seq_tis": {
        "bypass_mode": True,
        "loss_type": "reinforce",
        "rollout_is": "sequence",
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": _GEO,
    },
    "bypass_pg_geo_rs_token_tis": {
        "bypass_mode": True,
        "loss_type": "reinforce",
        "rollout_is": "token",
        "rollout_rs": "seq_mean_k1",
        "rollout_rs_threshold": _GEO,
    },
}
"""verl's ``RolloutCorrectionConfig`` factory methods by name, with their default arguments."""

PresetName = Literal[
    "disabled",
    "decoupled_token_is",
    "decoupled_seq_is",
    "decoupled_token_icepop",
    "decoupled_seq_is_rs",
    "decoupled_geo_rs",
    "decoupled_geo_rs_seq_tis",
    "decoupled_geo_rs_token_tis",
    "decoupled_k3_rs",
    "decoupled_k3_rs_seq_tis",
    "decoupled_k3_rs_token_tis",
    "bypass_ppo_clip",
    "bypass_ppo_clip_geo_rs",
    "bypass_ppo_clip_k3_rs",
    "bypass_pg_is",
    "bypass_pg_token_icepop",
    "bypass_pg_geo_rs",
    "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis",
]


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """``(upper, lower)`` of an IS threshold: a number (truncated IS: clamp at ``upper``;
    ``lower`` None) or ``"lower_upper"`` (IcePop: zero outside ``[lower, upper]``)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise TypeError(f"rollout_is_threshold must be a number or 'lower_upper', not {spec!r}")
    text = str(spec).strip()
    lower_text, _, upper_text = text.partition("_") if "_" in text else ("", "", text)
    try:
        upper = float(upper_text)
        lower = float(lower_text) if lower_text else None
    except ValueError as exc:
        raise ValueError(f"invalid rollout_is_threshold {spec!r}") from exc
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r}: need 0 < lower <= upper")
    return upper, lower


def rs_option_list(rollout_rs: str) -> list[str]:
    """The comma-separated rejection options, each once, in order; unknown ones refused."""
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [option for option in options if option not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_rs {rollout_rs!r}: options must be among {RS_OPTIONS}")
    return options


def parse_rs_thresholds(
    options: list[str], spec: str | float | None
) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower, upper)}``: one spec shared by all options or one per option
    (comma-separated). A k1 option bounds the ratio ``pi_rollout / pi_train`` by
    ``"lower_upper"`` (a bare ``upper`` means ``1/upper`` below); k2/k3 take an upper bound
    only (their lower is None)."""
    if spec is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = [part.strip() for part in str(spec).split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold {spec!r}: one value, or one per option")
    specs = specs * len(options) if len(specs) == 1 else specs
    return {option: _rs_bounds(option, text) for option, text in zip(options, specs, strict=True)}


def _rs_bounds(option: str, text: str) -> tuple[float | None, float]:
    if not option.endswith("k1") and "_" in text:
        raise ValueError(f"rollout_rs_threshold for {option} is one upper bound, not {text!r}")
    try:
        lower_text, _, upper_text = text.partition("_") if "_" in text else ("", "", text)
        upper = float(upper_text)
        lower = (
            float(lower_text) if lower_text else (1.0 / upper if option.endswith("k1") else None)
        )
    except (ValueError, ZeroDivisionError) as exc:
        raise ValueError(f"invalid rollout_rs_threshold {text!r} for {option}") from exc
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_rs_threshold {text!r} for {option}: need 0 < lower <= upper")
    return lower, upper


class RolloutCorrectionConfig(Section):
    preset: PresetName | None = None
    """One of verl's presets by its factory name (``decoupled_token_is``, ``bypass_pg_is``,
    ...; docs/algorithms.md lists them): fills the fields below that the config does not set
    itself, with verl's default arguments."""
    rollout_is: Literal["token", "sequence"] | None = None
    """Importance weights pi_old / pi_rollout on the policy loss: ``token`` (one per token;
    biased, low variance) or ``sequence`` (the product over the response; unbiased, high
    variance); None = no weights (the mismatch metrics are still logged)."""
    rollout_is_threshold: str | float = 2.0
    """A number: truncated IS, weights clamped at it. ``"lower_upper"`` (e.g. ``"0.5_5.0"``):
    IcePop, weights outside ``[lower, upper]`` set to 0. Unquoted is fine: rlfleet's YAML reads
    ``0.5_5`` as that text (YAML 1.2 numbers), not as the number 0.55 as YAML 1.1 would."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their batch mean (tokens, or sequences for ``sequence``)."""
    rollout_rs: str | None = None
    """Rejection sampling: comma-separated options of ``RS_OPTIONS`` (``token_k1``,
    ``seq_sum_k1``, ``seq_mean_k1``, ``seq_mean_k3``, ...); a token or sequence failing any
    is left out of the loss. None = no rejection."""
    rollout_rs_threshold: str | float | None = None
    """Bounds of ``rollout_rs``, one for all options or one per option (comma-separated): k1
    options bound the ratio pi_rollout / pi_train, ``"lower_upper"`` or a bare upper (lower =
    1/upper); k2/k3 options an upper bound on the divergence. ``0.5_2`` unquoted stays that text
    (``ConfigLoader``: YAML 1.2 numbers), never the number 0.52."""
    bypass_mode: bool = False
    """Use the engine's log-probs as the old policy (no actor forward for them; 2 policies
    instead of 3); the weights and rejection are then computed in the loss from the current
    policy against the engine's. False (decoupled): the actor's forward before the update is
    the old policy, corrected toward the engine's once per batch."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass mode's loss: ``ppo_clip`` (the PPO ratio is already against the rollout policy,
    so no extra weights) or ``reinforce`` (-A * w * log pi, with the IS weights)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        """A preset's values under the fields the config sets itself."""
        if isinstance(data, dict) and data.get("preset") in PRESETS:
            return {**PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        """Thresholds parse at load, and a bypass REINFORCE loss has something to weigh by."""
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(rs_option_list(self.rollout_rs), self.rollout_rs_threshold)
        return self

    @property
    def active(self) -> bool:
        """Whether any correction changes the loss (weights, rejection or bypass)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode

    @property
    def decoupled(self) -> bool:
        """Weights or rejection computed once per batch from the actor's old log-probs."""
        return self.active and not self.bypass_mode
