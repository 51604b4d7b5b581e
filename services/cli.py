"""The ``rlfleet`` command: one verb per role, plus ``up``, ``score`` and ``status``.

Verbs are resolved lazily (module path strings) so ``rlfleet --help`` imports nothing heavy.
"""

from __future__ import annotations

import importlib
import sys

VERBS: dict[str, tuple[str, str]] = {
    "up": ("rlfleet.launch.up", "run the whole fleet as local processes, or Ray actors (--ray)"),
    "trainer": ("rlfleet.trainer.main", "the controller: GRPO/PPO training loop"),
    "rollout": ("rlfleet.rollout.main", "one rollout replica (vLLM or transformers engine)"),
    "router": (
        "rlfleet.rollout.router.main",
        "the generation front door (least in-flight, sticky)",
    ),
    "reward": ("rlfleet.reward.main", "the reward service (gRPC, optional HTTP) and its workers"),
    "refcritic": ("rlfleet.refcritic.main", "reference-policy log-probs and the critic"),
    "env": ("rlfleet.env.main", "agent episodes: the Env service and its episode workers"),
    "score": ("rlfleet.reward.score_cli", "score a JSONL file through the reward service"),
    "data": ("rlfleet.launch.data_filter", "prompt data: `data filter` keeps prompts by pass rate"),
    "status": ("rlfleet.status_cli", "show replicas, versions and trainer state"),
    "dashboard": ("rlfleet.dashboard.main", "the live web page of a run (rlfleet up starts it)"),
    "slurm": ("rlfleet.launch.slurm", "write (and sbatch) a Slurm job: Ray, then `up --ray`"),
    "scale": ("rlfleet.launch.scale", "scale rollout replicas of a running `up --ray`"),
    "certs": ("rlfleet.launch.certs", "a CA and per-role certificates for mutual TLS (dev)"),
}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: rlfleet <verb> [--help] [options]", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {summary}" for verb, (_, summary) in VERBS.items()]
    lines += [
        "",
        "Every service verb takes --config FILE, dotted overrides (a.b=c) and --help-config.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"rlfleet: unknown verb {verb!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    result = module.main(rest)
    return int(result or 0)


def run() -> None:
    """The ``rlfleet`` console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    run()
