"""``rlfleet status``: the fleet as a table in the terminal (the dashboard's fleet look).

Replicas (id, state, weight version, in flight, served, queue), roles' health, queue depths and
the trainer's state, from the same probe as the dashboard (``rlfleet.dashboard.probe``): the
router's replica list, or the registry in Redis when no router answers (with ``redis_url``).
Then the run's health: the rules of ``rlfleet.trainer.health`` that fire on ``run_dir``'s
``metrics.jsonl``, with the thresholds the trainer recorded (``config.trainer.yaml``).
``--run-dir DIR`` takes the addresses from ``DIR/endpoints.json`` (what ``rlfleet up`` wrote);
``--watch [S]`` redraws every S seconds until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from rlfleet.common.config import RlfleetConfig
from rlfleet.common.config.health import HealthConfig
from rlfleet.common.entry import base_parser, resolve
from rlfleet.dashboard.probe import FleetProbe
from rlfleet.dashboard.runfiles import health_findings
from rlfleet.trainer.metrics import read_rows, standing_rows

REPLICA_COLUMNS = [
    ("replica", "replica_id"),
    ("state", "state"),
    ("version", "weight_version"),
    ("in_flight", "in_flight"),
    ("served", "served"),
    ("queued", "queued"),
    ("prefix_hit", "prefix_hit"),
    ("heartbeat", "heartbeat"),
    ("address", "address"),
]


def run_dir_overrides(run_dir: str) -> list[str]:
    """Dotted overrides pointing this config at the fleet recorded in ``run_dir``."""
    path = Path(run_dir) / "endpoints.json"
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"rlfleet status: cannot read {path}: {exc}") from exc
    out = [f"run_dir={run_dir}"]
    for role in ("router", "reward", "refcritic", "trainer"):
        if "grpc" in entries.get(role, {}):
            out.append(f"endpoints.{role}={entries[role]['grpc']}")
    url = entries.get("redis", {}).get("url", "")
    if url.startswith("redis") and "***" not in url:  # a masked password cannot be used
        out.append(f"redis_url={url}")
    return out


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    return [line(headers), *(line(r) for r in rows)]


def replica_cells(r: dict[str, Any]) -> list[str]:
    q = r.get("queue") or {}
    cells = {
        **{k: str(v) for k, v in r.items()},
        "state": r["state"] if r["up"] else f"DOWN {r['state']}",
        "queued": depth(q),
        "prefix_hit": "-"
        if r.get("prefix_cache_hit_rate") is None
        else f"{100 * r['prefix_cache_hit_rate']:.1f}%",
        "heartbeat": "-" if r["heartbeat_age_s"] < 0 else f"{r['heartbeat_age_s']:.1f}s",
    }
    return [cells[key] for _, key in REPLICA_COLUMNS]


def depth(queue: dict[str, int]) -> str:
    return "?" if queue.get("error") else f"{queue.get('waiting', 0)}+{queue.get('pending', 0)}"


def render(fleet: dict[str, Any]) -> list[str]:
    """The fleet look as lines: replicas, roles, queues, trainer."""
    replicas = fleet["replicas"]
    lines = [f"replicas ({len(replicas)}, from {fleet['replica_source']}):"]
    lines += [
        "  " + s
        for s in table([h for h, _ in REPLICA_COLUMNS], [replica_cells(r) for r in replicas])
    ]
    lines.append("roles:")
    lines += [
        "  " + s
        for s in table(
            ["role", "address", "health"],
            [
                [r["name"], r["address"], "up" if r["up"] else f"DOWN ({r['seen']})"]
                for r in fleet["roles"]
            ],
        )
    ]
    queues = fleet["queues"]
    depths = [f"{name} {depth(q)}" for name, q in queues.items()]
    lines.append("queues (waiting + in work): " + (", ".join(depths) or "none"))
    t = fleet["trainer"]
    lines.append(
        f"trainer: {t['state']} step {t['step']}/{t['total_steps']} weights v{t['weight_version']}"
        if t["up"]
        else f"trainer: not reachable ({t['seen']})"
    )
    return lines


def recorded_health(run_dir: Path, fallback: HealthConfig) -> HealthConfig:
    """The ``trainer.health`` the run's trainer recorded in ``config.trainer.yaml``, else
    ``fallback`` (this command's own)."""
    try:
        recorded = yaml.safe_load((run_dir / "config.trainer.yaml").read_text())
        return HealthConfig(**recorded["trainer"]["health"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return fallback


def health_lines(config: RlfleetConfig) -> list[str]:
    """The run's health: one line per rule that fires on ``run_dir/metrics.jsonl``."""
    run_dir = Path(config.run_dir)
    rows = standing_rows(read_rows(run_dir / "metrics.jsonl"))
    if not rows:
        return [f"health: no metrics in {run_dir} yet"]
    found = health_findings(run_dir, rows, recorded_health(run_dir, config.trainer.health))
    if not found:
        return [f"health: ok (step {rows[-1]['step']}, no rule fires)"]
    return [
        f"health: {len(found)} warning(s) (step {rows[-1]['step']}):",
        *(f"  WARNING {f['rule']}: {f['message']}" for f in found),
    ]


async def collect(config: RlfleetConfig) -> list[str]:
    probe = FleetProbe(config)
    try:
        return render(await probe.fleet()) + health_lines(config)
    finally:
        await probe.close()


async def watch(config: RlfleetConfig, every_s: float) -> None:
    probe = FleetProbe(config)
    try:
        while True:
            lines = render(await probe.fleet()) + health_lines(config)
            sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
            sys.stdout.flush()
            await asyncio.sleep(every_s)
    finally:
        await probe.close()


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("status", "Show replicas, roles, queues and the trainer's state.")
    parser.add_argument("--run-dir", help="take the fleet's addresses from DIR/endpoints.json")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="S",
        help="redraw every S seconds (default 2) until Ctrl-C",
    )
    args, _ = parser.parse_known_intermixed_args(argv)
    extra = run_dir_overrides(args.run_dir) if args.run_dir else []
    rest = [a for a in (argv or []) if a not in ("--watch",)]
    config, args = resolve(parser, "status", ["log_level=WARNING", *rest, *extra])
    if args.watch:
        try:
            asyncio.run(watch(config, args.watch))
        except KeyboardInterrupt:
            return 0
    print("\n".join(asyncio.run(collect(config))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
