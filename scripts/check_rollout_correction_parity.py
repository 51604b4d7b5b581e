"""Check that rlfleet's rollout correction computes exactly what verl's does.

Why a script and not a test: verl is not a dependency, so its wheel is downloaded
``--no-deps`` into the rlfleet cache (as ``scripts/check_verl_parity.py`` does for the reward
files) and only the code under comparison is loaded from it: the whole of
``verl/trainer/ppo/rollout_corr_helper.py``, the masked sums and means of
``verl/utils/torch_functional.py`` it calls, the ``RolloutCorrectionConfig`` presets of
``verl/trainer/config/algorithm.py``, and the bypass-mode, REINFORCE and PPO-clip losses
with ``agg_loss`` of ``verl/trainer/ppo/core_algos.py`` (the functions are taken from the
files by name; their other imports, Ray, tensordict and omegaconf among them, are stood in
for by small stubs that the compared code never calls for anything that changes a number).

On many random batches (random shapes, masks with empty rows, log-ratios from tiny to past
the +-20 safety bound, float32 and float64) and random settings (token/sequence IS with
truncation or IcePop bounds, batch normalization, one to three rejection options with
per-option thresholds) it compares every weight, mask, loss, gradient and metric, and
exits non-zero on any difference beyond float tolerance.

    python scripts/check_rollout_correction_parity.py [--verl 0.9.1] [--batches 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import ast
import math
import random
import sys
import types
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

import torch
from check_verl_parity import verl_wheel

from rlfleet.common.config.rollout_correction import PRESETS, RS_OPTIONS, RolloutCorrectionConfig
from rlfleet.rl import rollout_correction as ours
from rlfleet.rl.losses import LossInputs, LossParams, bypass_policy_loss
from rlfleet.rl.rollout_correction_metrics import mismatch_metrics

RTOL, ATOL = 1e-5, 1e-6


def _functions(source: str, names: set[str], namespace: dict) -> dict:
    """Exec only the named top-level functions/classes of ``source`` into ``namespace``."""
    tree = ast.parse(source)
    picked = [node for node in tree.body if getattr(node, "name", None) in names]
    missing = names - {node.name for node in picked}  # type: ignore[attr-defined]
    if missing:
        raise SystemExit(f"verl's file no longer defines {sorted(missing)}")
    exec(compile(ast.Module(body=picked, type_ignores=[]), "<verl>", "exec"), namespace)  # noqa: S102
    return namespace


class _Proto:
    """Stands in for verl's DataProto: only ``from_dict(tensors=...)`` and ``.batch``."""

    def __init__(self, tensors: dict) -> None:
        self.batch = tensors

    @classmethod
    def from_dict(cls, tensors: dict) -> _Proto:
        return cls(tensors)


class _Config(dict):
    """Stands in for verl's actor config: attributes and ``.get`` over one dict."""

    __getattr__ = dict.__getitem__


def load_verl(version: str) -> dict[str, Any]:
    """verl's helper module, its loss functions and its config class, from the wheel."""
    with zipfile.ZipFile(verl_wheel(version)) as archive:
        read = lambda name: archive.read(name).decode()  # noqa: E731
        helper_src = read("verl/trainer/ppo/rollout_corr_helper.py")
        functional_src = read("verl/utils/torch_functional.py")
        core_src = read("verl/trainer/ppo/core_algos.py")
        algorithm_src = read("verl/trainer/config/algorithm.py")
    verl_f = types.ModuleType("verl.utils.torch_functional")
    names = {"masked_sum", "masked_mean", "distributed_masked_mean"}
    verl_f.__dict__.update(_functions(functional_src, names, {"torch": torch}))
    helper = types.ModuleType("verl.trainer.ppo.rollout_corr_helper")
    sys.modules.update(  # stays for the script's life: the bypass loss imports the helper
        {
            "verl": types.ModuleType("verl"),
            "verl.utils": types.ModuleType("verl.utils"),
            "verl.utils.torch_functional": verl_f,
            "verl.protocol": types.SimpleNamespace(DataProto=_Proto),  # type: ignore[dict-item]
            "verl.trainer.config.algorithm": types.SimpleNamespace(RolloutCorrectionConfig=dict),  # type: ignore[dict-item]
            "verl.workers.config.actor": types.SimpleNamespace(PolicyLossConfig=dict),  # type: ignore[dict-item]
            "verl.trainer.ppo.rollout_corr_helper": helper,
        }
    )
    exec(compile(helper_src, "rollout_corr_helper.py", "exec"), helper.__dict__)  # noqa: S102
    core_names = {
        "agg_loss",
        "compute_policy_loss_vanilla",
        "compute_policy_loss_reinforce",
        "compute_policy_loss_bypass_mode",
    }
    core = {
        "torch": torch,
        "verl_F": verl_f,
        "Optional": Optional,
        "Any": Any,
        "ActorConfig": _Config,
        "AlgoConfig": type("AlgoConfig", (), {}),
        "register_policy_loss": lambda name: lambda fn: fn,
    }
    _functions(core_src, core_names, core)
    algo = {
        "dataclass": dataclass,
        "Optional": Optional,
        "Any": Any,
        "BaseConfig": type("BaseConfig", (), {}),
    }
    _functions(algorithm_src, {"RolloutCorrectionConfig"}, algo)
    return {
        "helper": helper,
        "core": core,
        "config": algo["RolloutCorrectionConfig"],
        "verl_f": verl_f,
    }


# --- random inputs ------------------------------------------------------------------------
def random_batch(rng: random.Random, dtype: torch.dtype):
    """``(old, rollout, mask)``, ``[B, T]``: at least one token; some rows empty."""
    rows, width = rng.randint(1, 8), rng.randint(1, 12)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    rollout = -torch.rand(rows, width, generator=gen, dtype=dtype) * rng.choice([0.5, 3.0, 8.0])
    scale = rng.choice([0.0, 1e-4, 1e-3, 0.01, 0.1, 0.5, 2.0, 12.0])
    old = rollout + torch.randn(rows, width, generator=gen, dtype=dtype) * scale
    lengths = [rng.randint(0, width) if rng.random() < 0.85 else 0 for _ in range(rows)]
    if not any(lengths):
        lengths[rng.randrange(rows)] = rng.randint(1, width)
    mask = torch.zeros(rows, width, dtype=dtype)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    if rng.random() < 0.3:  # agent-style holes in the middle of responses
        holes = torch.rand(rows, width, generator=gen) < 0.2
        if (mask * ~holes).any():
            mask = mask * ~holes
    return old, rollout, mask


def random_is_threshold(rng: random.Random):
    upper = round(rng.uniform(1.0005, 6.0), 4)
    if rng.random() < 0.4:
        return f"{round(rng.uniform(0.05, 1.0), 4)}_{upper}"
    return upper if rng.random() < 0.7 else str(upper)


def random_rs(rng: random.Random) -> tuple[str, str | float]:
    options = rng.sample(RS_OPTIONS, rng.randint(1, 3))
    specs = [_rs_spec(rng, option) for option in options]
    if rng.random() < 0.3 and len({o.endswith("k1") for o in options}) == 1:
        specs = specs[:1]
    spec: str | float = ",".join(specs)
    if len(specs) == 1 and not options[0].endswith("k1") and rng.random() < 0.5:
        spec = float(specs[0])
    return ",".join(options), spec


def _rs_spec(rng: random.Random, option: str) -> str:
    if option.endswith("k1"):
        width = rng.choice([1e-3, 0.01, 0.1, 0.5, 1.0, 3.0])
        upper = round(1 + width * rng.random() + 1e-4, 6)
        if rng.random() < 0.3:
            return str(upper)
        return f"{round(max(1e-4, 1 - width * rng.random()), 6)}_{upper}"
    return str(round(rng.choice([1e-4, 1e-3, 0.01, 0.1, 1.0, 10.0]) * rng.uniform(0.5, 2), 8))


# --- comparisons --------------------------------------------------------------------------
class Differences:
    """Counts the comparisons and prints the first few differences."""

    def __init__(self) -> None:
        self.checked = 0
        self.wrong = 0
        self.skipped: dict[str, int] = {}
        """Cases left out on purpose, by reason."""
        self.verl_errors: dict[str, int] = {}
        """verl raising where ours answers (its ESS divides by zero when IcePop zeroes every
        weight): counted and reported, not compared."""

    def verl_raised(self, error: Exception) -> None:
        name = f"{type(error).__name__}: {error}"
        self.verl_errors[name] = self.verl_errors.get(name, 0) + 1

    def value(self, what: str, mine, theirs) -> None:
        self.checked += 1
        if _same(mine, theirs):
            return
        self.wrong += 1
        if self.wrong <= 20:
            print(f"DIFF {what}: ours {mine!r} verl {theirs!r}")

    def metrics(self, what: str, mine: dict, theirs: dict) -> None:
        self.value(f"{what} metric names", sorted(mine), sorted(theirs))
        for name in sorted(set(mine) & set(theirs)):
            if name.endswith("_std"):  # compared as variances: see _same_std
                self.checked += 1
                base = name.removesuffix("_std")
                scale = max(abs(float(theirs.get(f"{base}_{end}", 1.0))) for end in ("max", "min"))
                if not _same_std(float(mine[name]), float(theirs[name]), scale):
                    self.value(f"{what} {name}", float(mine[name]), float(theirs[name]))
                continue
            self.value(f"{what} {name}", float(mine[name]), float(theirs[name]))


def _same_std(mine: float, theirs: float, scale: float) -> bool:
    """Stds of ``sqrt(E[x^2] - E[x]^2)`` agree to float tolerance on the variance, not on
    its square root: verl's masked mean divides by ``count + 1e-8``, which in float64 leaves
    a spurious variance of up to ~2e-9 of ``E[x^2]`` (ours divides by the count), and the
    root of that is ~1e-5: the same number, read through a square root. ``scale`` bounds
    ``|x|`` (the statistic's max and min), so ``E[x^2] <= scale^2``."""
    tolerance = ATOL + 1e-8 * max(1.0, scale) ** 2
    return math.isclose(mine * mine, theirs * theirs, rel_tol=RTOL, abs_tol=tolerance)


def _same(mine, theirs) -> bool:
    if isinstance(mine, torch.Tensor) or isinstance(theirs, torch.Tensor):
        if mine is None or theirs is None or mine.shape != theirs.shape:
            return False
        return torch.allclose(mine.double(), theirs.double(), RTOL, ATOL, equal_nan=True)
    if isinstance(mine, float) and isinstance(theirs, float):
        if math.isnan(mine) or math.isnan(theirs):
            return math.isnan(mine) and math.isnan(theirs)
        return math.isclose(mine, theirs, rel_tol=RTOL, abs_tol=ATOL)
    return mine == theirs


def check_pieces(verl, rng: random.Random, diff: Differences, dtype: torch.dtype) -> None:
    """Each function on its own: weights, rejection mask, mismatch metrics."""
    helper = verl["helper"]
    old, rollout, mask = random_batch(rng, dtype)
    log_ratio = old - rollout
    level, threshold, norm = (
        rng.choice(["token", "sequence"]),
        random_is_threshold(rng),
        rng.random() < 0.3,
    )
    mine = ours.is_weights(log_ratio, mask, level, threshold, norm)
    try:
        theirs = helper.compute_rollout_correction_weights(log_ratio, mask, level, threshold, norm)
    except ZeroDivisionError as error:
        diff.verl_raised(error)
    else:
        diff.value(f"is_weights {level} {threshold}", mine[0], theirs[0])
        diff.metrics(f"is_weights {level} {threshold}", mine[1], theirs[1])
    options, spec = random_rs(rng)
    mine = ours.rejection_mask(log_ratio, mask, options, spec)
    theirs = helper.compute_rollout_rejection_mask(log_ratio, mask, options, spec)
    diff.value(f"rejection_mask {options} {spec}", mine[0], theirs[0])
    diff.metrics(f"rejection_mask {options} {spec}", mine[1], theirs[1])
    with_rollout = rollout if rng.random() < 0.9 else None
    diff.metrics(
        "mismatch_metrics",
        mismatch_metrics(old, with_rollout, mask),
        helper.compute_offpolicy_metrics(old, with_rollout, mask),
    )


def random_params(rng: random.Random) -> ours.CorrectionParams:
    options, spec = random_rs(rng) if rng.random() < 0.6 else (None, None)
    return ours.CorrectionParams(
        rollout_is=rng.choice([None, "token", "sequence"]),
        rollout_is_threshold=random_is_threshold(rng),
        rollout_is_batch_normalize=rng.random() < 0.3,
        rollout_rs=options,
        rollout_rs_threshold=spec,
        bypass_mode=rng.random() < 0.5,
        loss_type=rng.choice(["ppo_clip", "reinforce"]),
    )


def check_whole(verl, rng: random.Random, diff: Differences, dtype: torch.dtype) -> None:
    """The batch entry (``correct``) and bypass mode's loss, with its gradient."""
    old, rollout, mask = random_batch(rng, dtype)
    params = random_params(rng)
    knobs = dict(
        rollout_is=params.rollout_is,
        rollout_is_threshold=params.rollout_is_threshold,
        rollout_is_batch_normalize=params.rollout_is_batch_normalize,
        rollout_rs=params.rollout_rs,
        rollout_rs_threshold=params.rollout_rs_threshold,
    )
    mine = ours.correct(old, rollout, mask, params)
    try:
        proto, their_mask, their_metrics = verl[
            "helper"
        ].compute_rollout_correction_and_rejection_mask(old, rollout, mask, **knobs)
    except ZeroDivisionError as error:
        diff.verl_raised(error)
        return
    what = f"correct {knobs}"
    diff.value(
        f"{what} weights", mine.weights, proto.batch["rollout_is_weights"] if proto else None
    )
    diff.value(f"{what} mask", mine.mask, their_mask)
    diff.metrics(what, mine.metrics, their_metrics)
    check_bypass_loss(verl, rng, diff, (old, rollout, mask), params, knobs)


def check_bypass_loss(verl, rng, diff, batch, params, knobs) -> None:
    old, rollout, mask = batch
    # Not seq-mean-token-sum-norm: rlfleet's agg_loss divides that mode's token sum by the
    # horizon only (Dr. GRPO), verl 0.9.1's also by the number of sequences; the loss
    # aggregation is rlfleet's own, not the correction's.
    mode = rng.choice(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
    if not ours.correct(old, rollout, mask, params).mask.any():
        diff.skipped["bypass loss with every token rejected (verl's token-mean is 0/0 = nan)"] = (
            diff.skipped.get(
                "bypass loss with every token rejected (verl's token-mean is 0/0 = nan)", 0
            )
            + 1
        )
        return
    advantages = torch.randn(old.shape, dtype=old.dtype)
    clip = rng.choice([0.1, 0.2, 0.28])
    grads = []
    for side in ("ours", "verl"):
        logprob = old.clone().requires_grad_(True)
        if side == "ours":
            loss_params = LossParams(
                clip_ratio_low=clip,
                clip_ratio_high=clip,
                clip_ratio_c=3.0,
                loss_agg_mode=mode,
                correction=params,
            )
            inputs = LossInputs(
                logits=torch.zeros(0),
                logprob=logprob,
                old_logprob=rollout,
                advantages=advantages,
                response_mask=mask,
                rollout_logprob=rollout,
            )
            out, metrics = bypass_policy_loss(loss_params, inputs)
            loss, metrics = out.pg_loss, {**metrics, "actor/ppo_kl": float(out.ppo_kl)}
        else:
            policy_loss = {"rollout_correction": {**knobs, "loss_type": params.loss_type}}
            config = _Config(
                clip_ratio=clip,
                clip_ratio_low=clip,
                clip_ratio_high=clip,
                clip_ratio_c=3.0,
                global_batch_info={},
                policy_loss=policy_loss,
            )
            try:
                loss, metrics = verl["core"]["compute_policy_loss_bypass_mode"](
                    rollout, logprob, advantages, mask, mode, config
                )
            except ZeroDivisionError as error:
                diff.verl_raised(error)
                return
            metrics = {k: v for k, v in metrics.items() if not k.startswith("actor/pg_clip")}
        loss.backward()
        grads.append((loss.detach(), logprob.grad, metrics))
    what = f"bypass {params.loss_type} {mode} {knobs}"
    diff.value(f"{what} loss", grads[0][0], grads[1][0])
    diff.value(f"{what} grad", grads[0][1], grads[1][1])
    diff.metrics(what, grads[0][2], grads[1][2])


def check_presets(verl, diff: Differences) -> None:
    """Every verl factory method with its defaults against ``preset: <its name>``."""
    verl_config = verl["config"]
    names = {name for name in vars(verl_config) if isinstance(vars(verl_config)[name], classmethod)}
    diff.value("preset names", sorted(PRESETS), sorted(names))
    fields = (
        "rollout_is",
        "rollout_is_threshold",
        "rollout_rs",
        "rollout_rs_threshold",
        "bypass_mode",
        "loss_type",
        "rollout_is_batch_normalize",
    )
    for name in sorted(names & set(PRESETS)):
        theirs = getattr(verl_config, name)()
        mine = RolloutCorrectionConfig(preset=name)
        for field in fields:
            mine_value, their_value = getattr(mine, field), getattr(theirs, field)
            if field == "rollout_is" and name == "disabled":
                their_value = None
            diff.value(f"preset {name} {field}", _spec(mine_value), _spec(their_value))


def _spec(value):
    """Thresholds compare as numbers when they are one number (2.0 == "2.0")."""
    try:
        return (
            float(value)
            if isinstance(value, str | int | float) and not isinstance(value, bool)
            else value
        )
    except ValueError:
        return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", default="0.9.1")
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    verl = load_verl(args.verl)
    rng = random.Random(args.seed)
    diff = Differences()
    check_presets(verl, diff)
    for i in range(args.batches):
        dtype = torch.float64 if i % 4 == 3 else torch.float32
        check_pieces(verl, rng, diff, dtype)
        check_whole(verl, rng, diff, dtype)
    print(
        f"verl {args.verl}: {args.batches} random batches x 5 entry points, "
        f"{diff.checked} values compared, {diff.wrong} differences "
        f"(rtol {RTOL}, atol {ATOL})"
    )
    for reason, count in diff.skipped.items():
        print(f"  not compared: {reason}: {count} times")
    for error, count in diff.verl_errors.items():
        print(f"  not compared: verl raised {error!r} {count} times (ours answers)")
    return 1 if diff.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
