"""Difficulty pools: training prompts drawn by how likely their group is to teach something.

Why: a GRPO group whose n samples all scored the same has zero advantage and moves nothing
(DAPO's filter drops such groups after paying for their generation). A prompt the model always
solves, or never does, keeps producing such groups; drawing prompts in proportion to the chance
that their group has a spread puts a step's generation where the signal is. The chance for a
pass rate ``p`` and a group of ``n`` is ``1 - p**n - (1 - p)**n``.

Each prompt's pass rate is an exponential moving average of its groups' mean scores
(``data.pass_rate_sampling.ema``). A run sees most prompts at most once (SmolLM2's recipe
draws ~800 of 4,000 prompts in 30 minutes), so a prompt not seen yet takes its pool's estimate
instead: the share of its ``data_source``'s groups that had a spread, smoothed toward 1 by
``prior_groups`` pseudo-groups (a family nobody sampled yet is tried). Every weight is at
least ``floor``, so a solved or hopeless prompt is still drawn now and then (forgetting,
or a prompt that became solvable). Scores are read as pass/fail at ``> 0.5`` for the spread
test; the pass rate itself averages the scores.

Related: prime-rl's and PipelineRL's online difficulty filtering, verl's curriculum samplers
(``data.sampler``), DAPO (Yu et al. 2025, arXiv:2503.14476) for the zero-variance argument.
The state (pass rates, pool counts, the random stream) is saved in checkpoints; batches an
async producer had drawn but not trained when a checkpoint was written are not drawn again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlfleet.common.errors import InvalidArgument
from rlfleet.trainer.data import PromptRecord


@dataclass(frozen=True)
class PassRateSettings:
    group_size: int
    """Samples per prompt (``rollout.n``): the ``n`` of the spread probability."""
    ema: float = 0.5
    floor: float = 0.05
    prior_groups: float = 2.0


def spread_probability(pass_rate: np.ndarray, group_size: int) -> np.ndarray:
    """Chance that a group of ``group_size`` samples with per-sample ``pass_rate`` holds both a
    pass and a fail. [P] -> [P]."""
    return 1.0 - pass_rate**group_size - (1.0 - pass_rate) ** group_size


class PassRateSampler:
    """An endless iterator of prompt batches (distinct prompts within a batch), weighted by
    each prompt's chance of a group with a spread; ``observe`` feeds it scored groups."""

    def __init__(
        self,
        records: Sequence[PromptRecord],
        batch_size: int,
        seed: int,
        settings: PassRateSettings,
    ) -> None:
        if not 1 <= batch_size <= len(records):
            raise InvalidArgument(f"batch size {batch_size} must be in [1, {len(records)} prompts]")
        self.records, self.batch_size, self.settings = list(records), batch_size, settings
        self._index = {id(record): i for i, record in enumerate(self.records)}
        self.pools = sorted({r.data_source for r in self.records})
        self._pool_of = np.array([self.pools.index(r.data_source) for r in self.records])
        self.pass_rate = np.zeros(len(self.records))
        self.seen: np.ndarray = np.zeros(len(self.records), dtype=bool)
        self.pool_groups = np.zeros(len(self.pools))
        self.pool_spread = np.zeros(len(self.pools))
        self._rng = np.random.default_rng(seed)
        self._last_weights = np.zeros(0)

    def __iter__(self) -> PassRateSampler:
        return self

    def __next__(self) -> list[PromptRecord]:
        weights = self.weights()
        chosen = self._rng.choice(
            len(self.records), size=self.batch_size, replace=False, p=weights / weights.sum()
        )
        self._last_weights = weights[chosen]
        return [self.records[i] for i in chosen]

    def weights(self) -> np.ndarray:
        """Each prompt's draw weight (unnormalised). [P]."""
        s = self.settings
        own = spread_probability(self.pass_rate, s.group_size)
        pool = (self.pool_spread + s.prior_groups) / (self.pool_groups + s.prior_groups)
        return np.maximum(np.where(self.seen, own, pool[self._pool_of]), s.floor)

    def observe(self, records: Sequence[PromptRecord], scores: Sequence[float]) -> None:
        """Fold in scored rows (one per sample, a group's rows sharing its record); rows of
        records this sampler did not draw (validation, another file) are ignored."""
        groups: dict[int, list[float]] = {}
        for record, score in zip(records, scores, strict=True):
            index = self._index.get(id(record))
            if index is not None:
                groups.setdefault(index, []).append(float(score))
        for index, group in groups.items():
            self._fold(index, group)

    def _fold(self, index: int, scores: list[float]) -> None:
        mean = float(np.mean(scores))
        ema = self.settings.ema
        seen = self.seen[index]
        self.pass_rate[index] = ema * mean + (1 - ema) * self.pass_rate[index] if seen else mean
        self.seen[index] = True
        passed = [score > 0.5 for score in scores]
        pool = self._pool_of[index]
        self.pool_groups[pool] += 1
        self.pool_spread[pool] += float(any(passed) and not all(passed))

    def metrics(self) -> dict[str, float]:
        """``data/pass_rate/*``: prompts seen, the drawn batch's mean weight (its expected
        share of groups with a spread), and each pool's observed share of such groups."""
        out = {
            "data/pass_rate/seen_prompts": float(self.seen.sum()),
            "data/pass_rate/drawn_weight_mean": float(np.mean(self._last_weights))
            if self._last_weights.size
            else 0.0,
        }
        for pool, name in enumerate(self.pools):
            if self.pool_groups[pool]:
                share = self.pool_spread[pool] / self.pool_groups[pool]
                out[f"data/pass_rate/spread_share/{name or 'unknown'}"] = float(share)
        return out

    def state(self) -> dict:
        """Everything a resumed run needs to go on drawing as this one would have."""
        return {
            "pass_rate": self.pass_rate.tolist(),
            "seen": self.seen.tolist(),
            "pools": list(self.pools),
            "pool_groups": self.pool_groups.tolist(),
            "pool_spread": self.pool_spread.tolist(),
            "rng": self._rng.bit_generator.state,
        }

    def load_state(self, state: dict) -> None:
        if len(state["pass_rate"]) != len(self.records) or state["pools"] != self.pools:
            raise InvalidArgument(
                "the checkpoint's pass-rate sampler was saved for other training data "
                f"({len(state['pass_rate'])} prompts, pools {state['pools']}; now "
                f"{len(self.records)} prompts, pools {self.pools})"
            )
        self.pass_rate = np.array(state["pass_rate"], dtype=float)
        self.seen = np.array(state["seen"], dtype=bool)
        self.pool_groups = np.array(state["pool_groups"], dtype=float)
        self.pool_spread = np.array(state["pool_spread"], dtype=float)
        self._rng.bit_generator.state = state["rng"]


def prompt_stream(trainer, records: Sequence[PromptRecord]):
    """The RL prompt batches of ``trainer``'s run, continued where a resumed run stopped: a
    ``PassRateSampler`` (state from the checkpoint, fed by the collector's scored groups) when
    ``data.pass_rate_sampling.enable``, else ``batches``' shuffled order, replayed to
    ``trainer.batches_consumed``."""
    from rlfleet.trainer.data import batches

    cfg = trainer.config
    if not cfg.data.pass_rate_sampling.enable:
        data = batches(records, cfg.data.train_batch_size, cfg.data.seed)
        for _ in range(trainer.batches_consumed):
            next(data)
        return data
    knobs = cfg.data.pass_rate_sampling
    settings = PassRateSettings(cfg.rollout.n, knobs.ema, knobs.floor, knobs.prior_groups)
    sampler = PassRateSampler(records, cfg.data.train_batch_size, cfg.data.seed, settings)
    if trainer.sampler_state is not None:
        sampler.load_state(trainer.sampler_state)
    trainer.prompt_sampler = sampler
    trainer.collector.on_scored = lambda batch: sampler.observe(batch.records, batch.scores)
    return sampler
