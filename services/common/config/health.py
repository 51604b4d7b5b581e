"""``trainer.health``: the thresholds of the run-health rules (``rlfleet.trainer.health``).

Why config: each rule compares a metric with a bound, and the right bound depends on the
recipe. The defaults fire on a deliberately broken run of the default job (a learning rate 100x
too high, a replica that serves stale weights) and stay quiet on the shipped recipes; the tests
hold both (tests/unit/test_health_runs.py, test_health_broken_runs.py). A threshold of 0 turns
its rule off.
"""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config.base import Section


class HealthConfig(Section):
    enabled: bool = True
    """Judge the run's health every step: a WARNING line when a rule fires (once, until it
    clears), ``health/<rule>`` (0/1) in each metrics row, a banner on the dashboard, a list in
    ``rlfleet status``."""
    warmup_steps: int = Field(10, ge=0)
    """No rule fires before this many training steps: the first steps of a healthy run are
    its noisiest (the policy and the engine settle, the first pushes land)."""
    window: int = Field(5, ge=1, le=1000)
    """Steps averaged by the smoothed rules (entropy, mismatch, zero-variance groups): one
    noisy step fires nothing."""
    entropy_min_fraction: float = Field(0.1, ge=0, lt=1)
    """``entropy_collapse`` fires when ``actor/entropy`` (mean of the last ``window`` steps)
    falls below this fraction of its first value: the policy stopped exploring."""
    max_mismatch_kl: float = Field(0.1, ge=0)
    """``mismatch_kl`` fires when ``rollout_corr/kl`` (median of the last ``window`` steps)
    exceeds this: the engine samples from another policy than the trainer learns."""
    max_mismatch_chi2: float = Field(1.0, ge=0)
    """``mismatch_chi2`` fires when ``rollout_corr/chi2_token`` (median of the last ``window``
    steps) exceeds this: the importance weights' variance blew up."""
    flat_steps: int = Field(20, ge=0)
    """``reward_flat`` fires when ``critic/score/mean`` moved by no more than
    ``flat_tolerance`` over this many steps: every sample scores alike, nothing is learned."""
    flat_tolerance: float = Field(1e-3, ge=0)
    """What counts as not moving: for ``reward_flat`` the spread (max - min), for
    ``heldout_flat`` the gain over the first validation."""
    flat_validations: int = Field(4, ge=0)
    """``heldout_flat`` fires when the held-out accuracy (``val-core/*/mean@1``, averaged over
    data sources) beat its first validation by no more than ``flat_tolerance`` in any of this
    many last validations: the run learns nothing that generalizes. Not flat against itself:
    a converged run (its learning rate decayed) holds its accuracy exactly, and is fine."""
    max_zero_variance_fraction: float = Field(0.9, ge=0, le=1)
    """``zero_variance`` fires when more than this share of the batch's groups (mean of the
    last ``window`` steps) scored all alike: their group-relative advantage is 0."""
    max_rejected_fraction: float = Field(0.3, ge=0, le=1)
    """``heavy_rejection`` fires when rollout-correction rejection
    (``algorithm.rollout_correction.rollout_rs``) masked more than this share of the sampled
    tokens (mean of the last ``window`` steps; judged from the first ``window`` steps, warm-up
    or not): the update learns from few tokens. Between the preset runs of docs/algorithms.md:
    the collapsed ones rejected 41-97% of their responses in steps 1-50, the healthy ones
    2-13%. 0 turns it off."""
    stall_factor: float = Field(10.0, ge=0)
    """``stalled`` fires when a step takes more than this many times the run's median step,
    and more than ``stall_min_s``; ``rlfleet status`` and the dashboard judge the wait for the
    next step the same way. The slowest phase names the role that stalled."""
    stall_min_s: float = Field(60.0, ge=0)
    """The least time that counts as a stall (a slow step of a fast run is not one)."""
    throughput_window: int = Field(20, ge=1, le=250)
    """Steps whose median tokens per second (``perf/total_num_tokens`` / ``timing_s/step``)
    ``throughput_drop`` compares with the run's median over its last 500 steps."""
    min_throughput_fraction: float = Field(0.25, ge=0, lt=1)
    """``throughput_drop`` fires when the median tokens per second of the last
    ``throughput_window`` steps falls below this fraction of the run's median: replicas went
    away, or something slows every step. Not tighter: a machine shared with other work swings
    by 2-3x (the default job on 2 cores beside a test suite: down to 0.31), no fault of the run."""
