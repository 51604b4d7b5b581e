"""Run health: a few rules over the step metrics that say when a run is going wrong.

Why: a run that breaks (a learning rate far too high, a replica serving stale weights, a
scorer that returns a constant) rarely crashes; it keeps logging numbers that someone has to
read off the curves. Each rule here watches one signal the RL literature ties to a failure,
fires with the numbers that tripped it, and clears when the signal recovers:

- ``entropy_collapse`` (``actor/entropy``, mean of the last ``window`` steps, below
  ``entropy_min_fraction`` = 0.1 of its first value): the policy stopped exploring, the
  collapse DAPO's clip-higher answers (Yu et al. 2025, arXiv:2503.14476).
- ``mismatch_kl`` (``rollout_corr/kl``, median of ``window`` steps, above 0.1) and
  ``mismatch_chi2`` (``rollout_corr/chi2_token``, above 1): the engine samples from another
  policy than the one trained, the mismatch verl's rollout correction measures (Yao et al.
  2025, "Your efficient RL framework secretly brings you off-policy RL training").
- ``reward_flat`` (``critic/score/mean`` within ``flat_tolerance`` = 0.001 for
  ``flat_steps`` = 20 steps): a batch mean that does not even wobble means every sample
  scores alike, so nothing is learned. ``heldout_flat`` (held-out ``val-core/*/mean@1`` no
  better than its first validation + 0.001 in each of the last ``flat_validations`` = 4):
  the run learns nothing that generalizes (or unlearns).
- ``zero_variance`` (``batch/zero_variance_fraction``, or DAPO's dropped share, above 0.9):
  groups whose samples all scored alike have zero group-relative advantage (DAPO's argument).
- ``heavy_rejection`` (``rollout_corr/rollout_rs_masked_fraction``, mean of ``window`` steps,
  above ``max_rejected_fraction`` = 0.3): rollout-correction rejection (``rollout_rs``) masks
  most sampled tokens, so the update learns from few of them. Judged from the first ``window``
  steps, not after the warm-up: a bound too tight for the run's policy lag (verl's k3 and
  geometric defaults under async staleness) rejects nearly everything from the first step,
  and every step of the warm-up would be lost.
- ``stalled`` (``timing_s/step`` over ``stall_factor`` = 10 times the run's median and over
  ``stall_min_s`` = 60 s): a role hangs; the slowest phase names it. ``rlfleet status`` and the
  dashboard also judge the wait for the next row this way.
- ``throughput_drop`` (``perf/total_num_tokens`` / ``timing_s/step``, median over
  ``throughput_window`` = 20 steps, below 0.25 of the median of the last 500): replicas went
  away, or something slows every step.

A rule whose metric is absent stays silent; none fires in the first ``warmup_steps`` = 10
steps. The defaults fire on a broken run of the default job and stay quiet on the shipped
recipes (tests/unit/test_health_runs.py, test_health_broken_runs.py). Everything here is
pure over metrics dicts; the only side effect is ``HealthMonitor``'s log line.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from rlfleet.common.config.health import HealthConfig

log = logging.getLogger(__name__)

PREFIX = "health/"
"""Each rule's flag in the metrics row: ``health/<rule>`` is 1 while it fires, else 0."""
ENTROPY, KL, CHI2 = "actor/entropy", "rollout_corr/kl", "rollout_corr/chi2_token"
REWARD, STEP_S = "critic/score/mean", "timing_s/step"
ZERO_VAR, TOKENS = "batch/zero_variance_fraction", "perf/total_num_tokens"
REJECTED = "rollout_corr/rollout_rs_masked_fraction"
HELDOUT, THROUGHPUT = "heldout", "throughput"
"""Series the trace derives: held-out accuracy, tokens per second."""
STALL_HISTORY = 50
"""Steps whose median ``stalled`` compares a step with."""
THROUGHPUT_HISTORY = 500
"""Steps whose median ``throughput_drop`` compares the recent steps with."""
PHASE_ROLES = {
    "timing_s/gen": "rollout (generation)",
    "timing_s/idle_trainer": "rollout (the trainer waited for batches)",
    "timing_s/reward": "reward",
    "timing_s/ref": "refcritic (reference log-probs)",
    "timing_s/values": "refcritic (values)",
    "timing_s/update_critic": "refcritic (critic update)",
    "timing_s/old_log_prob": "trainer (old log-probs)",
    "timing_s/update_actor": "trainer (actor update)",
    "timing_s/push_weights": "rollout (weight push)",
}
"""The phases of a step and the role each waits on."""


@dataclass(frozen=True)
class Finding:
    """One rule firing: its name and the numbers that tripped it."""

    rule: str
    message: str

    def line(self) -> str:
        return f"{self.rule}: {self.message}"


class Trace:
    """What the rules read of the rows so far: each watched metric's last values (bounded),
    its first value, the last training row."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        keep = (
            max(
                config.window,
                config.flat_steps,
                config.flat_validations,
                2 * config.throughput_window,
                STALL_HISTORY,
                THROUGHPUT_HISTORY,
            )
            + 1
        )
        self.series: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=keep))
        self.first: dict[str, float] = {}
        self.steps = 0
        self.last: Mapping[str, float] = {}

    def add(self, row: Mapping[str, float]) -> None:
        """One metrics row: a training step's (it has ``training/global_step``) or a
        validation's (``val-core/...``)."""
        if "training/global_step" in row:
            self.steps += 1
            self.last = row
            for name, value in training_values(row).items():
                self._append(name, value)
        heldout = heldout_accuracy(row)
        if heldout is not None:
            self._append(HELDOUT, heldout)

    def _append(self, name: str, value: float) -> None:
        self.first.setdefault(name, value)
        self.series[name].append(value)

    def last_values(self, name: str, count: int) -> list[float]:
        values = self.series.get(name, ())
        return list(values)[-count:] if count else []

    def median_of(self, name: str, count: int, full: bool = False) -> float | None:
        """The median of the last ``count`` values (None when none, or fewer with ``full``)."""
        values = self.last_values(name, count)
        if not values or (full and len(values) < count):
            return None
        return statistics.median(values)


def training_values(row: Mapping[str, float]) -> dict[str, float]:
    """The watched metrics of one training row, with the derived ones."""
    watched = (ENTROPY, KL, CHI2, REWARD, STEP_S, REJECTED)
    out = {name: float(row[name]) for name in watched if name in row}
    zero = zero_variance_share(row)
    if zero is not None:
        out[ZERO_VAR] = zero
    if TOKENS in row and row.get(STEP_S, 0) > 0:
        out[THROUGHPUT] = float(row[TOKENS]) / float(row[STEP_S])
    return out


def zero_variance_share(row: Mapping[str, float]) -> float | None:
    """The share of groups that scored all alike: DAPO's dropped share when dynamic sampling
    is on (the trained batch then holds none), else ``batch/zero_variance_fraction``."""
    if "dapo/dropped_groups" in row and "dapo/kept_groups" in row:
        dropped, kept = float(row["dapo/dropped_groups"]), float(row["dapo/kept_groups"])
        return dropped / (dropped + kept) if dropped + kept else None
    return float(row[ZERO_VAR]) if ZERO_VAR in row else None


def heldout_accuracy(row: Mapping[str, float]) -> float | None:
    """The greedy held-out accuracy, averaged over data sources (None: no validation here)."""
    values = [
        float(v) for k, v in row.items() if k.startswith("val-core/") and k.endswith("/mean@1")
    ]
    return sum(values) / len(values) if values else None


def entropy_collapse(trace: Trace, cfg: HealthConfig) -> str | None:
    values, first = trace.last_values(ENTROPY, cfg.window), trace.first.get(ENTROPY)
    if not values or not first or first <= 0 or not cfg.entropy_min_fraction:
        return None
    mean = sum(values) / len(values)
    if mean >= cfg.entropy_min_fraction * first:
        return None
    return (
        f"{ENTROPY} {mean:.4g} (mean of the last {len(values)} steps) fell below "
        f"{cfg.entropy_min_fraction:g} x its first value {first:.4g}"
    )


def _median_above(trace: Trace, name: str, bound: float, window: int) -> str | None:
    median = trace.median_of(name, window)
    if median is None or not bound or median <= bound:
        return None
    count = len(trace.last_values(name, window))
    return f"{name} {median:.4g} (median of the last {count} steps) > {bound:g}"


def mismatch_kl(trace: Trace, cfg: HealthConfig) -> str | None:
    return _median_above(trace, KL, cfg.max_mismatch_kl, cfg.window)


def mismatch_chi2(trace: Trace, cfg: HealthConfig) -> str | None:
    return _median_above(trace, CHI2, cfg.max_mismatch_chi2, cfg.window)


def _flat(trace: Trace, name: str, count: int, tolerance: float, unit: str) -> str | None:
    values = trace.last_values(name, count)
    if not count or len(values) < count or max(values) - min(values) > tolerance:
        return None
    return f"stayed within {min(values):.4g}..{max(values):.4g} for {count} {unit}"


def reward_flat(trace: Trace, cfg: HealthConfig) -> str | None:
    found = _flat(trace, REWARD, cfg.flat_steps, cfg.flat_tolerance, "steps")
    return found and f"{REWARD} {found}"


def heldout_flat(trace: Trace, cfg: HealthConfig) -> str | None:
    """Flat against the first validation, not against itself: a healthy run that converged
    (and whose learning rate decayed) holds its accuracy exactly, which is no fault."""
    count, first = cfg.flat_validations, trace.first.get(HELDOUT)
    values = trace.last_values(HELDOUT, count)
    if not count or first is None or len(values) < count:
        return None
    if max(values) > first + cfg.flat_tolerance:
        return None
    return (
        f"held-out accuracy (val-core/*/mean@1) {max(values):.4g} at best over the last "
        f"{count} validations, no better than the first {first:.4g}"
    )


def zero_variance(trace: Trace, cfg: HealthConfig) -> str | None:
    values = trace.last_values(ZERO_VAR, cfg.window)
    bound = cfg.max_zero_variance_fraction
    if not values or not bound or sum(values) / len(values) <= bound:
        return None
    return (
        f"{sum(values) / len(values):.0%} of the groups scored all alike (mean of the "
        f"last {len(values)} steps) > {bound:.0%}: their advantage is 0"
    )


def heavy_rejection(trace: Trace, cfg: HealthConfig) -> str | None:
    values, bound = trace.last_values(REJECTED, cfg.window), cfg.max_rejected_fraction
    if len(values) < cfg.window or not bound or sum(values) / len(values) <= bound:
        return None
    return (
        f"rollout correction rejected {sum(values) / len(values):.0%} of the sampled tokens "
        f"(mean of the last {len(values)} steps) > {bound:.0%}: widen algorithm."
        "rollout_correction's rejection bounds or lower the policy lag (trainer.max_staleness)"
    )


def stalled(trace: Trace, cfg: HealthConfig) -> str | None:
    """The last step, against the median of the steps before it."""
    times = trace.last_values(STEP_S, STALL_HISTORY + 1)
    if len(times) < 2:
        return None
    return stall_message(times[-1], statistics.median(times[:-1]), cfg, trace.last)


def stall_message(
    seconds: float, median: float, cfg: HealthConfig, row: Mapping[str, float] | None = None
) -> str | None:
    """``seconds`` (a step, or the wait for the next) over the stall bound, said with the
    slowest phase of ``row`` and the role it waits on; None when within it."""
    if not cfg.stall_factor or seconds <= max(cfg.stall_factor * median, cfg.stall_min_s):
        return None
    said = f"{seconds:.1f} s, {seconds / max(median, 1e-9):.0f}x the median step {median:.2f} s"
    row = row or {}
    phases = {k: float(row[k]) for k in PHASE_ROLES if k in row}
    if not phases:
        return said
    slowest = max(phases, key=lambda k: phases[k])
    return f"{said}; slowest phase {slowest} {phases[slowest]:.1f} s: {PHASE_ROLES[slowest]}"


def throughput_drop(trace: Trace, cfg: HealthConfig) -> str | None:
    """Against the run's own median over its last ``THROUGHPUT_HISTORY`` steps, not its best
    moment: a machine shared with other work swings by 2-3x (measured on the 2-core default
    job), and that alone is no fault."""
    values, window = trace.last_values(THROUGHPUT, THROUGHPUT_HISTORY), cfg.throughput_window
    if not cfg.min_throughput_fraction or len(values) < 2 * window:
        return None
    recent, usual = statistics.median(values[-window:]), statistics.median(values)
    if recent >= cfg.min_throughput_fraction * usual:
        return None
    return (
        f"{recent:.4g} tokens/s (median of the last {window} steps) < "
        f"{cfg.min_throughput_fraction:g} x the run's median {usual:.4g} "
        f"(last {len(values)} steps)"
    )


Rule = Callable[[Trace, HealthConfig], "str | None"]
RULES: dict[str, Rule] = {
    "entropy_collapse": entropy_collapse,
    "mismatch_kl": mismatch_kl,
    "mismatch_chi2": mismatch_chi2,
    "reward_flat": reward_flat,
    "heldout_flat": heldout_flat,
    "zero_variance": zero_variance,
    "stalled": stalled,
    "throughput_drop": throughput_drop,
    "heavy_rejection": heavy_rejection,
}
"""Every rule by name (the ``health/<name>`` flag); each returns its message when it fires."""


EARLY_RULES = frozenset({"heavy_rejection"})
"""Rules judged during the warm-up too: their signal is a setting's fault, not early noise."""


def judge(trace: Trace, cfg: HealthConfig) -> dict[str, Finding]:
    """The rules that fire on what ``trace`` holds (only the early ones during the warm-up)."""
    early = trace.steps < cfg.warmup_steps
    rules = {name: rule for name, rule in RULES.items() if not early or name in EARLY_RULES}
    found = {name: rule(trace, cfg) for name, rule in rules.items()}
    return {name: Finding(name, message) for name, message in found.items() if message}


class HealthMonitor:
    """The rules over a run's rows as they come: ``observe`` each row, read the flags."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.trace = Trace(config)
        self.active: dict[str, Finding] = {}

    def observe(self, row: Mapping[str, float]) -> dict[str, float]:
        """Add one row; a WARNING names each rule that fires now and did not before (once
        until it clears). Returns the ``health/<rule>`` flags for a metrics row ({} when off)."""
        if not self.config.enabled:
            return {}
        self.trace.add(row)
        now = judge(self.trace, self.config)
        for name in now.keys() - self.active.keys():
            log.warning("run health: %s", now[name].line())
        for name in self.active.keys() - now.keys():
            log.info("run health: %s cleared", name)
        self.active = now
        return {PREFIX + name: float(name in now) for name in RULES}

    def replay(self, rows: Iterable[Mapping[str, float]]) -> None:
        """Take in rows silently (a resumed run's, or a metrics file read as it grows)."""
        for row in rows:
            self.trace.add(row)
        self.active = judge(self.trace, self.config) if self.config.enabled else {}

    def findings(self, waiting_s: float | None = None) -> list[Finding]:
        """The rules firing now. ``waiting_s``: how long the run has been on its next step
        (the age of its metrics file, for a run not finished), judged like a step by
        ``stalled``: a role that hangs stops the rows, so no row would ever say so."""
        found = dict(self.active)
        times = self.trace.last_values(STEP_S, STALL_HISTORY)
        judged = self.config.enabled and self.trace.steps >= self.config.warmup_steps
        if waiting_s is not None and times and judged:
            waited = stall_message(waiting_s, statistics.median(times), self.config)
            if waited:
                found["stalled"] = Finding("stalled", f"no step for {waited}")
        return list(found.values())


def assess(
    rows: Iterable[Mapping[str, float]], config: HealthConfig, waiting_s: float | None = None
) -> list[Finding]:
    """The findings that stand after ``rows`` (a ``metrics.jsonl``: ``rlfleet status``), with
    the wait for the next step judged as ``HealthMonitor.findings`` does."""
    monitor = HealthMonitor(config)
    monitor.replay(rows)
    return monitor.findings(waiting_s)
