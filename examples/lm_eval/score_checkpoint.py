"""Score a finished run's final checkpoint with lm-evaluation-harness, through the router, and
compare with the trainer's own held-out number.

    python examples/lm_eval/score_checkpoint.py runs/grpo_smollm2_math

It serves ``RUN_DIR/checkpoints/final`` with ``rlfleet up --no-trainer`` (router + one replica
of the run's recipe), waits until the router's OpenAI front answers, runs the ``lm_eval`` CLI
(``local-chat-completions``, the ``rlfleet_basic_math`` task here, greedy, ``--limit`` rows),
stops the fleet, and prints both numbers and their difference. The record goes to
``RUN_DIR/lm_eval.json``. The command it runs is the one README.md here shows, so a user can
run the steps by hand as well.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ACCURACY_KEY = "val-core/all/reward/mean@1"
TOLERANCE = 0.02
READY_TIMEOUT_S = 900.0


def trainer_number(run_dir: Path, key: str = ACCURACY_KEY) -> float:
    """The trainer's held-out accuracy after training, from the run's ``summary.json``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    after = summary.get("val_after") or {}
    if key not in after:
        raise SystemExit(f"{run_dir}/summary.json has no val_after[{key!r}]")
    return float(after[key])


def chat_url(endpoints: dict) -> str:
    """The router's chat-completions URL from ``endpoints.json`` (its ``http`` ends in /v1)."""
    return endpoints["router"]["http"].rstrip("/") + "/chat/completions"


def served_model(url: str) -> str:
    """The model id the router serves (``GET /v1/models``; the checkpoint directory's name)."""
    models_url = url.rsplit("/chat/completions", 1)[0] + "/models"
    with urllib.request.urlopen(models_url, timeout=30) as reply:
        return json.load(reply)["data"][0]["id"]


def lm_eval_argv(url: str, model: str, limit: int, out_dir: Path, concurrency: int) -> list[str]:
    args = f"base_url={url},model={model},num_concurrent={concurrency},max_retries=3"
    return [
        *[sys.executable, "-m", "lm_eval", "--model", "local-chat-completions"],
        *["--apply_chat_template", "--model_args", f"{args},tokenized_requests=False"],
        *["--include_path", str(HERE), "--tasks", "rlfleet_basic_math"],
        *["--limit", str(limit), "--output_path", str(out_dir)],
    ]


def lm_eval_accuracy(out_dir: Path) -> float:
    """``acc`` of the task from the newest results file lm_eval wrote under ``out_dir``."""
    files = sorted(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise SystemExit(f"lm_eval wrote no results under {out_dir}")
    results = json.loads(files[-1].read_text())["results"]["rlfleet_basic_math"]
    return float(results.get("acc,none", results.get("acc")))


def serve(config: str, checkpoint: Path, serve_dir: Path, log) -> subprocess.Popen:
    argv = [
        *[sys.executable, "-m", "rlfleet.cli", "up", "--config", config],
        *["--rollout-replicas", "1", "--no-trainer"],
        f"model.path={checkpoint}",
        f"run_dir={serve_dir}",
    ]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(serve_dir: Path, fleet: subprocess.Popen) -> str:
    """The chat URL once a one-token greedy request through it is answered."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if fleet.poll() is not None:
            raise SystemExit(f"the serving fleet exited ({fleet.returncode}): see its log")
        try:
            url = chat_url(json.loads((serve_dir / "endpoints.json").read_text()))
            body = {
                "model": served_model(url),
                "max_tokens": 1,
                "messages": [{"role": "user", "content": "1"}],
            }
            request = urllib.request.Request(
                url, json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            urllib.request.urlopen(request, timeout=60).read()
            return url
        except (OSError, KeyError, ValueError):
            time.sleep(5)
    raise SystemExit(f"the router did not answer within {READY_TIMEOUT_S:.0f} s")


def stop(fleet: subprocess.Popen) -> None:
    if fleet.poll() is None:
        os.killpg(fleet.pid, signal.SIGINT)
        try:
            fleet.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(fleet.pid, signal.SIGKILL)
            fleet.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--config", default="configs/grpo_smollm2_math.yaml")
    parser.add_argument("--limit", type=int, default=256, help="rows (the recipe's val_size)")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    inside = trainer_number(args.run_dir)
    work = Path(tempfile.mkdtemp(prefix="rlfleet-lm-eval-"))
    with (work / "serve.log").open("wb") as log:
        fleet = serve(args.config, args.run_dir / "checkpoints" / "final", work / "serve", log)
        try:
            url = wait_ready(work / "serve", fleet)
            argv = lm_eval_argv(url, served_model(url), args.limit, work / "out", args.concurrency)
            subprocess.run(argv, check=True)
        finally:
            stop(fleet)
    outside = lm_eval_accuracy(work / "out")
    record = {"trainer": inside, "lm_eval": outside, "difference": round(outside - inside, 4)}
    record.update(limit=args.limit, within_tolerance=abs(outside - inside) <= TOLERANCE)
    (args.run_dir / "lm_eval.json").write_text(json.dumps(record, indent=1))
    print(f"trainer {inside:.4f}, lm-eval {outside:.4f}, difference {outside - inside:+.4f}")
    return 0 if record["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
