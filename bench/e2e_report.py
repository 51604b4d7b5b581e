"""Tables for the end-to-end benchmark: one row per run, from the records the runners return.

Why its own module: TRL's records (from ``e2e_trl.py``) and the fleet's (from
``e2e_fleet.py``) name their phases differently; this is the one place that maps both onto the
same columns, so a reader compares like with like.
"""

from __future__ import annotations

import statistics

import common

SPEED_COLUMNS = [
    "system",
    "work",
    "steps",
    "s/step median",
    "s/step clock",
    "gen",
    "reward",
    "ref+logprobs",
    "update",
    "push",
    "CPU s/step",
    "Redis cmds/step",
    "Redis KB/step",
    "gRPC KB/step",
    "load",
]
TTT_COLUMNS = [
    "system",
    "recipe",
    "seed",
    "time to target (s)",
    "steps to target",
    "best held-out",
    "last held-out",
    "training s",
    "stopped by",
    "load",
]
FLEET_PHASES = {
    "gen": ["gen"],
    "reward": ["reward"],
    "ref+logprobs": ["ref", "old_log_prob"],
    "update": ["update_actor", "update_critic"],
    "push": ["push_weights"],
}
TRL_PHASES = {
    "gen": ["gen"],
    "reward": ["reward"],
    "ref+logprobs": ["score_other"],
    "update": ["update"],
}


def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def _load(record: dict) -> str:
    load = record.get("load_avg", {})
    return f"{load.get('before', ['?'])[0]}→{load.get('after', ['?'])[0]}"


def speed_row(record: dict, warmup: int) -> dict:
    base = {"system": record["system"], "work": f"{record['batch']}x8", "load": _load(record)}
    if record.get("error"):
        return {**base, "s/step median": f"FAILED: {record['error'][:80]}"}
    if record["system"] == "trl":
        return {**base, **_trl_speed(record, warmup)}
    return {**base, **_fleet_speed(record)}


def _trl_speed(record: dict, warmup: int) -> dict:
    steps = record["steps"]
    kept = steps[warmup:] or steps
    row = {
        name: _median(sum(s.get(k, 0.0) for k in keys) for s in kept)
        for name, keys in TRL_PHASES.items()
    }
    return {
        **row,
        "steps": len(steps),
        "s/step median": _median(s["step_s"] for s in kept),
        "s/step clock": record["training_time_s"] / max(len(steps), 1),
        "push": "in-process",
        "CPU s/step": _median(s["cpu_s"] for s in kept),
        "Redis cmds/step": "none",
        "Redis KB/step": "none",
        "gRPC KB/step": "none",
    }


def _fleet_speed(record: dict) -> dict:
    phases = record["phases_median"]
    row = {name: sum(phases.get(k, 0.0) for k in keys) for name, keys in FLEET_PHASES.items()}
    window = record.get("window", {})
    steps = record["steps_done"]
    tcp = window.get("tcp_bytes_per_step", {})
    grpc = sum(sum(v.values()) for label, v in tcp.items() if label != "redis") / 1024
    redis_bytes = sum(window.get("redis_net_bytes_per_step", {}).values()) / 1024
    return {
        **row,
        "steps": steps,
        "s/step median": phases.get("step", float("nan")),
        "s/step clock": record["training_time_s"] / max(steps, 1),
        "CPU s/step": sum(window.get("cpu_s_per_step", {}).values()) if window else "n/a",
        "Redis cmds/step": window.get("redis_commands_per_step", "n/a"),
        "Redis KB/step": redis_bytes if window else "n/a",
        "gRPC KB/step": grpc if window else "n/a",
    }


def cpu_rows(records: list[dict], warmup: int) -> tuple[list[str], list[dict]]:
    """CPU seconds per step by process (fleet: measured between two steps; TRL: its one process)."""
    rows, labels = [], []
    for record in records:
        if record.get("error"):
            continue
        if record["system"] == "trl":
            per = {
                "trl": _median(s["cpu_s"] for s in (record["steps"][warmup:] or record["steps"]))
            }
        else:
            per = record.get("window", {}).get("cpu_s_per_step", {})
        labels += [k for k in per if k not in labels]
        rows.append({"system": record["system"], "work": f"{record['batch']}x8", **per})
    return ["system", "work", *labels], rows


def ttt_row(record: dict, target: float) -> dict:
    evals = record.get("evals") or [[0, 0.0, float("nan")]]
    best = max(evals, key=lambda e: e[2])
    reached = record.get("time_to_target_s")
    step = next((e[0] for e in evals if e[2] >= target), None)
    return {
        "system": record["system"],
        "recipe": record.get("recipe", "rlfleet default"),
        "seed": record["seed"],
        "load": _load(record),
        "time to target (s)": "not reached" if reached is None else reached,
        "steps to target": "—" if step is None else step,
        "best held-out": f"{best[2]:.3f} @ step {best[0]}",
        "last held-out": evals[-1][2],
        "training s": record.get("training_time_s", float("nan")),
        "stopped by": record.get("error") or record.get("stopped_by", "?"),
    }


def best_trl_recipe(records: list[dict], target: float) -> str | None:
    """The TRL recipe that reached the target in most seeds, then fastest, then most accurate."""
    by_recipe: dict[str, list[dict]] = {}
    for record in records:
        if record["system"] == "trl":
            by_recipe.setdefault(record["recipe"], []).append(record)

    def key(recipe: str):
        runs = by_recipe[recipe]
        times = [r["time_to_target_s"] for r in runs if r.get("time_to_target_s") is not None]
        accuracy = max((e[2] for r in runs for e in r.get("evals", [])), default=0.0)
        return (-len(times), _median(times) if times else float("inf"), -accuracy)

    return min(by_recipe, key=key) if by_recipe else None


def median_ttt(records: list[dict], system: str, recipe: str | None = None) -> float | None:
    """Median time to target over seeds; None unless every seed reached it."""
    runs = [
        r
        for r in records
        if r["system"] == system and (recipe is None or r.get("recipe") == recipe)
    ]
    times = [r.get("time_to_target_s") for r in runs]
    return _median(times) if runs and None not in times else None


def markdown(speed: list[dict], cpu: tuple[list[str], list[dict]], ttt: list[dict]) -> str:
    parts = [
        "## (a) Seconds per step at equal work, per-phase medians, traffic",
        "",
        common.markdown_table(SPEED_COLUMNS, speed),
        "",
        "## CPU seconds per step, by process",
        "",
        common.markdown_table(*cpu),
        "",
    ]
    if ttt:
        parts += [
            "## (b) Time to the held-out target",
            "",
            common.markdown_table(TTT_COLUMNS, ttt),
            "",
        ]
    return "\n".join(parts)
