"""``rlfleet trainer``: run one training job against a running fleet, then exit."""

from __future__ import annotations

import asyncio

from rlfleet.common.entry import base_parser, resolve


def print_summary(summary: dict) -> None:
    before, after = summary["val_before"], summary["val_after"]
    for name in after:
        start = f"{before[name]:.3f}" if name in before else "n/a"
        print(f"held-out {name}: {start} -> {after[name]:.3f}")
    print(f"steps: {summary['steps']}  wall time: {summary['wall_time_s']} s")
    reached = summary.get("time_to_target_s")
    print(f"time_to_{summary['target_accuracy']:g}_s: {'never' if reached is None else reached}")
    print(f"training time (validation excluded): {summary['training_time_s']} s")
    print(f"metrics: {summary['metrics_file']}")
    print(f"reward curve: {summary['reward_curve']}")
    print(f"report: {summary['report']}")
    print(f"checkpoint: {summary['checkpoint']}")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser("trainer", "The controller: trains the policy through the fleet.")
    config, _ = resolve(parser, "trainer", argv)
    if config.tinker.enabled:  # no loop of its own: serve the Tinker API (docs/tinker.md)
        from rlfleet.trainer.tinker.serve import serve

        asyncio.run(serve(config))
        return 0
    from rlfleet.trainer.run import run_training
    from rlfleet.trainer.server import control_server

    summary = asyncio.run(run_training(config, control_server(config)))
    print_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
