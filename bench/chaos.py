"""Chaos experiments against a real fleet: kill, stop and restart its parts under load.

Usage: ``python bench/chaos.py`` (``make chaos``; a few minutes on a 2-core machine). Writes
bench/results/chaos.json and chaos.md. ``--only NAME[,NAME]`` runs only those experiments (by
their function names, ``EXPERIMENTS``) and merges their rows into the results already there,
noting when each was measured: the other rows stay those of the last full run.

The fleet: an embedded Redis (AOF on, as ``rlfleet up`` starts it), two routers, two hf
replicas on the tiny model (each queued request held ``DELAY_S`` on its replica, so work is
in flight when the fault hits), and a reward service with a user function that hangs on one
input. Each experiment sends a burst of calls with unique request ids, injects one fault while
they are in flight, and counts:

- ``sent``: calls started; ``answered``: calls that got their answer (a caller whose router
  died retries once on the other router with the same request id, as the fleet's contract
  says a client may); ``lost``: calls that ended in an error or ran past their deadline;
- ``run_twice``: answers stored more than once (the replicas' ``served`` counters, summed,
  minus the answers; a lower bound: a killed replica's last count is read just before the
  kill). Each caller still receives one answer: answers are ``SET NX``;
- ``recovery_s``: from the fault to the last answer; ``max_latency_s``: the slowest call.

The experiments: SIGKILL a replica (restarted after), SIGSTOP a replica past its heartbeat TTL
(then SIGCONT), SIGSTOP both replicas past it (every lease lapses while its replica holds work,
and no live replica is left to move that work to: each must find its lease gone after SIGCONT,
register again and re-read its own stream), SIGKILL a router (restarted after), restart Redis with its AOF (SIGTERM, 2 s
down), restart Redis empty (SIGKILL, its AOF deleted, 2 s down), and a reward batch holding a
hanging item while other callers score small requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import common

TITLE = "Chaos: faults injected under load (real processes)"
DELAY_S = 0.5  # each queued request sleeps this long on its replica before generating
CALLS = 40  # Generate calls per experiment
SPACING_S = 0.025  # between call starts
CALL_TIMEOUT_S = 60.0
HEARTBEAT = ["rollout.heartbeat_interval_s=0.5", "rollout.heartbeat_ttl_s=2"]
HANG_MARKER = "hang-forever"
USER_FN = f'''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "{HANG_MARKER}":
        while True:
            time.sleep(1)
    return float(solution_str.strip() == ground_truth.strip())
'''
COLUMNS = ["experiment", "sent", "answered", "lost", "run_twice", "recovery_s", "max_latency_s"]


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    port: int = 0
    popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, env: dict[str, str]) -> Proc:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                cwd=common.REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self) -> None:
        if self.popen is not None:
            self.signal(signal.SIGCONT)
            common.stop_child(self.popen, grace_s=10, group=True)


@dataclass
class Fleet:
    work: Path
    redis: object
    cluster: str
    env: dict[str, str]
    procs: dict[str, Proc] = field(default_factory=dict)

    def common_args(self) -> list[str]:
        return [
            f"redis_url={self.redis.url}",
            f"cluster={self.cluster}",
            f"model.path={common.MODEL_DIR}",
        ]

    def spawn(self, name: str, module: str, args: list[str], port: int = 0) -> Proc:
        from rlfleet.common.redis_server import free_port

        port = port or free_port()
        argv = [sys.executable, "-m", module, *self.common_args(), *args, "--port", str(port)]
        proc = Proc(name, argv, self.work / f"{name}.log", port).start(self.env)
        self.procs[name] = proc
        return proc

    def replica(self, name: str) -> Proc:
        return self.spawn(
            name,
            "rlfleet.rollout.main",
            [
                "--replica-id",
                name,
                "rollout.backend=hf",
                "rollout.torch_threads=1",
                f"rollout.debug_generate_delay_s={DELAY_S}",
                *HEARTBEAT,
            ],
        )

    def router(self, name: str, port: int = 0) -> Proc:
        return self.spawn(
            name, "rlfleet.rollout.router.main", ["router.janitor_interval_s=0.3", *HEARTBEAT], port
        )

    def reward(self, user_fn: Path) -> Proc:
        return self.spawn(
            "reward",
            "rlfleet.reward.main",
            [
                f"reward.custom.path={user_fn}",
                "reward.custom.data_sources=[chaos]",
                "reward.sandbox_limits.timeout_s=3",
            ],
        )

    def restart(self, name: str) -> Proc:
        old = self.procs[name]
        old.stop()
        proc = Proc(name, old.argv, old.log, old.port).start(self.env)
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


# ---- load ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    answered: bool
    error: str = ""
    finished: float = 0.0  # monotonic time the call ended
    latency_s: float = 0.0


async def generate_burst(addresses: list[str], tag: str, fault) -> tuple[list[Outcome], float]:
    """``CALLS`` Generate calls (unique ids) through ``addresses[0]``; ``fault()`` is awaited
    once a third of them are in flight. Returns each call's outcome and the fault's time."""
    from rlfleet.rollout.client import RolloutClient
    from rlfleet.rollout.types import GenerateRequest, SamplingParams

    clients = [RolloutClient(a) for a in addresses]
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=4)

    async def call(i: int) -> Outcome:
        request = GenerateRequest(
            request_id=f"{tag}-{i}",
            session_id=f"{tag}-s{i % 8}",
            prompt_text="12+34=",
            sampling=sampling,
            timeout_s=CALL_TIMEOUT_S,
        )
        start, error = time.monotonic(), ""
        for client in clients:  # a caller whose router died retries on the next, same id
            try:
                result = await client.generate(request)
                ok = result.request_id == request.request_id
                return Outcome(
                    ok, "" if ok else "wrong id", time.monotonic(), time.monotonic() - start
                )
            except Exception as exc:  # noqa: BLE001 - counted as lost unless a retry answers
                error = f"{type(exc).__name__}: {exc}"
                if "UNAVAILABLE" not in error and "Unavailable" not in type(exc).__name__:
                    break
        return Outcome(False, error, time.monotonic(), time.monotonic() - start)

    try:
        tasks = []
        for i in range(CALLS):
            tasks.append(asyncio.create_task(call(i)))
            if i == CALLS // 3:
                await asyncio.sleep(0.2)  # the first third reach their replicas
                fault_at = time.monotonic()
                await fault()
            await asyncio.sleep(SPACING_S)
        return list(await asyncio.gather(*tasks)), fault_at
    finally:
        for client in clients:
            await client.close()


async def served(fleet: Fleet, names: list[str]) -> dict[str, int]:
    """Each live replica's ``served`` counter (answers it stored)."""
    from rlfleet.rollout.client import RolloutClient

    counts = {}
    for name in names:
        proc = fleet.procs[name]
        address = await replica_address(fleet, name)
        if proc.popen is None or proc.popen.poll() is not None or not address:
            continue
        try:
            async with RolloutClient(address) as client:
                counts[name] = (await asyncio.wait_for(client.status(), 5)).served
        except Exception:  # noqa: BLE001 - stopped or gone: no count
            pass
    return counts


async def replica_address(fleet: Fleet, name: str) -> str:
    import redis.asyncio as aioredis

    from rlfleet.common.keys import Keys

    client = aioredis.Redis.from_url(fleet.redis.url)
    try:
        raw = await client.hget(Keys(fleet.cluster).replica(name), "address")
        return raw.decode() if raw else ""
    finally:
        await client.aclose()


def row(name: str, outcomes: list[Outcome], fault_at: float, stored: int) -> dict:
    answered = sum(o.answered for o in outcomes)
    last = max((o.finished for o in outcomes if o.answered), default=fault_at)
    errors = sorted({o.error[:160] for o in outcomes if not o.answered})
    return {
        "experiment": name,
        "sent": len(outcomes),
        "answered": answered,
        "lost": len(outcomes) - answered,
        "run_twice": max(0, stored - answered),
        "recovery_s": round(last - fault_at, 2),
        "max_latency_s": round(max(o.latency_s for o in outcomes), 2),
        "errors": errors[:3],
    }


async def generate_experiment(fleet: Fleet, name: str, fault) -> dict:
    """One burst through router1 (router2 the fallback) with ``fault`` in the middle."""
    replicas = ["ra", "rb"]
    before = await served(fleet, replicas)
    last_seen = dict(before)

    async def fault_and_note() -> None:
        last_seen.update(await served(fleet, replicas))  # a killed replica's final count
        await fault()

    addresses = [fleet.procs["router1"].address, fleet.procs["router2"].address]
    outcomes, fault_at = await generate_burst(
        addresses, f"{name}-{uuid.uuid4().hex[:6]}", fault_and_note
    )
    await asyncio.sleep(1.0)  # late stores land
    after = {**last_seen, **await served(fleet, replicas)}
    stored = sum(after.get(r, 0) - before.get(r, 0) for r in replicas if r in before)
    result = row(name, outcomes, fault_at, stored)
    common.progress(f"{name}: {result}")
    return result


# ---- the faults ---------------------------------------------------------------------------


async def until_serving(fleet: Fleet, names: list[str], timeout_s: float = 240) -> None:
    import redis.asyncio as aioredis

    from rlfleet.common.keys import Keys

    keys, deadline = Keys(fleet.cluster), time.monotonic() + timeout_s
    client = aioredis.Redis.from_url(fleet.redis.url)
    try:
        while time.monotonic() < deadline:
            states = [await client.hget(keys.replica(n), "state") for n in names]
            if all(s == b"serving" for s in states):
                return
            dead = [n for n, p in fleet.procs.items() if p.popen and p.popen.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited; see {fleet.work}/*.log")
            await asyncio.sleep(0.5)
    finally:
        await client.aclose()
    raise RuntimeError(f"{names} not serving within {timeout_s:g} s")


async def kill_replica(fleet: Fleet) -> dict:
    result = await generate_experiment(
        fleet, "sigkill_replica", lambda: _signal(fleet, "ra", signal.SIGKILL)
    )
    fleet.restart("ra")
    await until_serving(fleet, ["ra", "rb"])
    return result


async def stop_replica(fleet: Fleet) -> dict:
    async def fault() -> None:
        fleet.procs["rb"].signal(signal.SIGSTOP)
        asyncio.get_running_loop().call_later(4.0, fleet.procs["rb"].signal, signal.SIGCONT)

    result = await generate_experiment(fleet, "sigstop_replica_4s", fault)
    await until_serving(fleet, ["ra", "rb"])
    return result


async def lapse_all_leases(fleet: Fleet) -> dict:
    """Both replicas stopped for twice the TTL while they hold work: the janitor finds no live
    replica to move it to, so it stays in their streams; after SIGCONT each finds its lease
    gone, registers again and runs what it held. recovery_s counts from the stop."""

    async def fault() -> None:
        for name in ("ra", "rb"):
            fleet.procs[name].signal(signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        for name in ("ra", "rb"):
            loop.call_later(4.0, fleet.procs[name].signal, signal.SIGCONT)

    logs = {n: fleet.procs[n].log for n in ("ra", "rb")}
    seen = {n: log.stat().st_size for n, log in logs.items()}  # logs are appended to
    result = await generate_experiment(fleet, "lease_lapse_all_replicas_4s", fault)
    await until_serving(fleet, ["ra", "rb"])
    lapses = sum(log.read_bytes()[seen[n] :].count(b"lost its lease") for n, log in logs.items())
    result["lease_lapses_logged"] = lapses  # 2 when both noticed they lost their lease
    return result


async def kill_router(fleet: Fleet) -> dict:
    result = await generate_experiment(
        fleet, "sigkill_router", lambda: _signal(fleet, "router1", signal.SIGKILL)
    )
    fleet.restart("router1")
    await asyncio.sleep(3.0)
    return result


async def restart_redis(fleet: Fleet, empty: bool) -> dict:
    from rlfleet.common.redis_server import EmbeddedRedis

    async def fault() -> None:
        server = fleet.redis
        if empty:
            server.kill()  # a crash, and its AOF gone with the disk
            fleet.redis = EmbeddedRedis(server.data_dir, port=server.port, fresh=True)
        else:
            server.stop()  # SIGTERM: it fsyncs its AOF
        asyncio.get_running_loop().call_later(2.0, fleet.redis.start)

    name = "redis_restart_empty" if empty else "redis_restart_aof"
    result = await generate_experiment(fleet, name, fault)
    await until_serving(fleet, ["ra", "rb"])
    return result


async def _signal(fleet: Fleet, name: str, sig: int) -> None:
    fleet.procs[name].signal(sig)


async def hanging_reward_item(fleet: Fleet) -> dict:
    """A batch with one hanging user-function item, and 20 one-item Score calls from another
    caller meanwhile: every item answered (the hung one with its timeout error)."""
    from rlfleet.reward.client import RewardClient
    from rlfleet.reward.types import ScoreRequest

    address = fleet.procs["reward"].address
    items = [
        ScoreRequest(id=f"b{i}", data_source="chaos", solution_str="46", ground_truth="46")
        for i in range(15)
    ]
    items.append(
        ScoreRequest(id="hang", data_source="chaos", solution_str=HANG_MARKER, ground_truth="46")
    )
    async with RewardClient(address) as batcher, RewardClient(address) as other:
        fault_at = time.monotonic()
        batch = asyncio.create_task(_timed(batcher.score_batch(items)))
        await asyncio.sleep(0.3)  # the hanging item holds a sandbox slot now
        small = []
        for i in range(20):
            request = ScoreRequest(
                id=f"s{i}", data_source="chaos", solution_str="7", ground_truth="7"
            )
            small.append(asyncio.create_task(_timed(other.score(request))))
            await asyncio.sleep(0.05)
        outcomes = [await batch, *[await s for s in small]]
    answered = [o for o in outcomes if o.answered]
    sent = len(items) + len(small)
    got = sum(len(o.value) if isinstance(o.value, list) else 1 for o in answered)
    result = {
        "experiment": "hanging_reward_item",
        "sent": sent,
        "answered": got,
        "lost": sent - got,
        "run_twice": 0,
        "recovery_s": round(max(o.finished for o in outcomes) - fault_at, 2),
        "max_latency_s": round(max(o.latency_s for o in outcomes[1:]), 2),
        "errors": sorted({o.error[:160] for o in outcomes if not o.answered})[:3],
        "hung_item_error": _hung_error(outcomes[0]),
    }
    common.progress(f"hanging_reward_item: {result}")
    return result


@dataclass
class Timed:
    answered: bool
    value: object = None
    error: str = ""
    finished: float = 0.0
    latency_s: float = 0.0


async def _timed(call) -> Timed:
    start = time.monotonic()
    try:
        value = await call
        return Timed(True, value, "", time.monotonic(), time.monotonic() - start)
    except Exception as exc:  # noqa: BLE001 - counted as lost
        return Timed(
            False, None, f"{type(exc).__name__}: {exc}", time.monotonic(), time.monotonic() - start
        )


def _hung_error(outcome: Timed) -> str:
    if not outcome.answered:
        return outcome.error[:160]
    hung = [r for r in outcome.value if r.id == "hang"]
    return (hung[0].error or "no error")[:160] if hung else "missing"


# ---- the run ------------------------------------------------------------------------------


async def restart_redis_aof(fleet: Fleet) -> dict:
    return await restart_redis(fleet, empty=False)


async def restart_redis_empty(fleet: Fleet) -> dict:
    return await restart_redis(fleet, empty=True)


EXPERIMENTS = {
    f.__name__: f
    for f in (
        kill_replica,
        stop_replica,
        lapse_all_leases,
        kill_router,
        restart_redis_aof,
        restart_redis_empty,
        hanging_reward_item,
    )
}
"""Every experiment, in the order a full run makes them (``--only`` picks among them)."""


async def experiments(fleet: Fleet, names: list[str]) -> list[dict]:
    await until_serving(fleet, ["ra", "rb"])
    await asyncio.sleep(2.0)  # routers see both replicas
    return [await EXPERIMENTS[name](fleet) for name in names]


def run(work: Path, names: list[str] | None = None) -> common.BenchResult:
    from rlfleet.common.redis_server import EmbeddedRedis

    work.mkdir(parents=True, exist_ok=True)
    user_fn = work / "hang_reward.py"
    user_fn.write_text(USER_FN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET_")}
    env["RLFLEET_RUN_DIR"] = str(work)
    redis = EmbeddedRedis(work / "redis", fresh=True).start()  # AOF on, as ``rlfleet up``
    fleet = Fleet(work, redis, f"chaos{uuid.uuid4().hex[:8]}", env)
    started = time.monotonic()
    try:
        fleet.router("router1")
        fleet.router("router2")
        fleet.replica("ra")
        fleet.replica("rb")
        names = names or list(EXPERIMENTS)
        if "hanging_reward_item" in names:
            fleet.reward(user_fn)
        rows = asyncio.run(experiments(fleet, names))
    finally:
        fleet.stop()
        fleet.redis.stop()
    result = common.BenchResult(
        "chaos",
        TITLE,
        COLUMNS,
        rows,
        {},
        params={
            "calls": CALLS,
            "replica_delay_s": DELAY_S,
            "heartbeat_ttl_s": 2,
            "call_timeout_s": CALL_TIMEOUT_S,
            "replicas": 2,
            "routers": 2,
            "backend": "hf",
        },
    )
    result.notes = notes(rows)
    result.seconds = time.monotonic() - started
    return result


def notes(rows: list[dict]) -> list[str]:
    out = [totals(rows)]
    out += [f"{r['experiment']}: errors {r['errors']}" for r in rows if r.get("errors")]
    out += [
        f"hanging_reward_item: the hung item's answer: {r['hung_item_error']}"
        for r in rows
        if "hung_item_error" in r
    ]
    out.append(
        "run_twice = answers stored beyond one per request (replicas' served counters; a "
        "lower bound). Every caller receives one answer (SET NX)."
    )
    return out


def merged(result: common.BenchResult, machine: dict, names: list[str]) -> tuple:
    """The committed full run with this partial run's rows put in (a row of the same
    experiment replaced in place, a new one appended) and a note saying when they were
    measured. Without a committed run the partial run stands alone."""
    path = common.RESULTS_DIR / "chaos.json"
    if not path.exists():
        return result, machine
    data = json.loads(path.read_text())
    fresh = {r["experiment"]: r for r in result.rows}
    rows = [fresh.pop(r["experiment"], r) for r in data["rows"]] + list(fresh.values())
    measured = ", ".join(r["experiment"] for r in result.rows)
    note = (
        f"{measured}: measured alone (--only {','.join(names)}) at {machine.get('timestamp')}, "
        f"commit {machine.get('git_commit')}, load average before "
        f"{result.load_avg.get('before')}, after {result.load_avg.get('after')}, "
        f"{result.seconds:.0f} s; the other rows are from the full run above."
    )
    kept = [
        n
        for n in data.get("notes", [])
        if not n.startswith(f"{measured}:") and not TOTALS.fullmatch(n)
    ]
    full = common.BenchResult(
        data["name"],
        data["title"],
        data["columns"],
        rows,
        data.get("ratios", {}),
        data.get("params", {}),
        [totals(rows), *kept, note],
        data.get("seconds", 0.0),
        data.get("load_avg", {}),
        data.get("error"),
    )
    return full, data["machine"]


TOTALS = re.compile(r"\d+ calls in all, \d+ lost\.")  # the first note: replaced on a merge


def totals(rows: list[dict]) -> str:
    return f"{sum(r['sent'] for r in rows)} calls in all, {sum(r['lost'] for r in rows)} lost."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated experiments: " + ", ".join(EXPERIMENTS) + " (default: all)",
    )
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    if unknown := [n for n in names if n not in EXPERIMENTS]:
        parser.error(f"unknown experiments {unknown}; choose among {list(EXPERIMENTS)}")
    work = common.RESULTS_DIR / "work" / "chaos"
    machine, load_before = common.machine_info(), common.load_avg()
    result = run(work, names or None)
    result.load_avg = {"before": load_before, "after": common.load_avg()}
    shown = result.rows
    if names:
        result, machine = merged(result, machine, names)
    path = common.write_result(result, machine, common.RESULTS_DIR)
    print(common.markdown_table(COLUMNS, shown))
    print(f"-> {path}")
    return 1 if any(r["lost"] for r in shown) else 0


if __name__ == "__main__":
    sys.exit(main())
