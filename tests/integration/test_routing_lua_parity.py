"""The routing rule's two copies agree: ``routing.pick_replica`` (with ``admission.admit``), what
batches and the janitor use, and the router's one-step enqueue Lua, what a single request gets,
run on the same generated fleets against a real Redis server and must make the same pick; and
a batch (``batch.assign``, one snapshot) lands where the same requests sent one after another
through the Lua would. The Python rule on its own: tests/unit/test_routing.py.
"""

from __future__ import annotations

import random

import redis.asyncio as aioredis

from rlfleet.common.errors import ResourceExhausted, Unavailable
from rlfleet.common.keys import Keys
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaInfo
from rlfleet.rollout.router.admission import admit
from rlfleet.rollout.router.batch import assign
from rlfleet.rollout.router.enqueue import Enqueuer, Placed, Placement
from rlfleet.rollout.router.routing import eligible, pick_replica
from rlfleet.rollout.types import GenerateRequest, SamplingParams


def replica(rid: str, version: int, state: str, alive: bool) -> ReplicaInfo:
    return ReplicaInfo(
        rid, f"127.0.0.1:{len(rid)}", weight_version=version, state=state, alive=alive
    )


# ---- the same rule in Lua: the router's one-step enqueue ----------------------------------

CASES = 300


class Coin:
    """An ``rng`` whose every draw is ``value``: the coin the enqueue step is handed."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


def random_fleet(rng: random.Random) -> dict:
    """A registry state, a request's demands and a coin, drawn to hit every branch often."""
    ids = sorted(rng.sample([f"r{i}" for i in range(6)], rng.randint(1, 5)))
    states = ["serving"] * 4 + ["updating", "paused", "starting"]
    fleet = [
        replica(rid, rng.randint(0, 3), rng.choice(states), rng.random() < 0.85) for rid in ids
    ]
    inflight = {rid: rng.choice([-1, 0, 0, 1, 2, 3, 5, 7]) for rid in ids if rng.random() < 0.8}
    session = rng.random() < 0.6
    return {
        "fleet": fleet,
        "inflight": inflight,
        "draining": {rid for rid in ids if rng.random() < 0.15},
        "sticky": rng.choice([*ids, None, "gone"]) if session else None,
        "session": session,
        "min_version": rng.randint(0, 2),
        "cap": rng.randint(1, 6),
        "limit": rng.choice([None, None, rng.randint(1, 6)]),
        "coin": rng.choice([0.0, 0.999999, rng.random(), rng.random()]),
    }


def python_pick(case: dict) -> str:
    """What batches and the janitor choose: admission, then ``pick_replica``."""
    snap = RegistrySnapshot(case["fleet"], dict(case["inflight"]), set(case["draining"]))
    try:
        snap = admit(snap, case["min_version"], case["limit"])
        return pick_replica(
            snap.replicas,
            snap.inflight,
            case["sticky"],
            case["min_version"],
            case["cap"],
            snap.draining,
            Coin(case["coin"]),
        )
    except Unavailable:
        return "unavailable"
    except ResourceExhausted:
        return "full"


async def lua_pick(redis: aioredis.Redis, keys: Keys, case: dict) -> str:
    """What a single request gets: the router's candidates (eligible replicas, sorted), then
    the enqueue Lua against the same state written to Redis."""
    pool = eligible(case["fleet"], case["min_version"], case["draining"])
    if not pool:
        return "unavailable"  # the router refuses before the Lua step
    session = "s" if case["session"] else ""
    await write_state(redis, keys, case, session)
    return await lua_enqueue(redis, keys, case, sorted(r.replica_id for r in pool), "q", session)


async def write_state(redis: aioredis.Redis, keys: Keys, case: dict, session: str) -> None:
    """The case's registry, counts, drains and pin, as the router's Redis holds them."""
    async with redis.pipeline(transaction=False) as pipe:
        for info in case["fleet"]:
            pipe.hset(keys.replica(info.replica_id), mapping=info.to_hash())
        if case["inflight"]:
            pipe.hset(keys.inflight, mapping=case["inflight"])
        if case["draining"]:
            pipe.sadd(keys.draining, *case["draining"])
        if session and case["sticky"]:
            pipe.set(keys.sticky(session), case["sticky"])
        await pipe.execute()


async def lua_enqueue(
    redis: aioredis.Redis, keys: Keys, case: dict, candidates: list[str], rid: str, session: str
) -> str:
    """One request through the enqueue Lua on the live state: where it was queued, or full."""
    request = GenerateRequest(
        rid,
        SamplingParams(),
        prompt_token_ids=[1],
        session_id=session,
        min_weight_version=case["min_version"],
    )
    placement = Placement(case["cap"], case["limit"], 60.0, case["coin"])
    placed = await Enqueuer(redis, keys).enqueue(
        request, request.fingerprint(), "sub", candidates, placement, 60
    )
    assert placed.outcome in (Placed.QUEUED, Placed.FULL), placed
    return placed.replica_id if placed.outcome is Placed.QUEUED else "full"


async def test_python_and_lua_routing_pick_the_same_replica(
    redis_client: aioredis.Redis, cluster_name: str
) -> None:
    rng, seen = random.Random(16), set()
    for index in range(CASES):
        case = random_fleet(rng)
        keys = Keys(f"{cluster_name}c{index}")  # a fresh registry per case
        expected = python_pick(case)
        assert await lua_pick(redis_client, keys, case) == expected, (index, case)
        seen.add("pinned" if expected == case["sticky"] else expected[:4])
    assert {"pinned", "unav", "full"} <= seen  # every branch was exercised


async def test_a_batch_lands_where_the_same_requests_one_by_one_would(
    redis_client: aioredis.Redis, cluster_name: str
) -> None:
    """``batch.assign`` places a batch from one snapshot, counting each placement as it goes;
    the Lua places each request on the live counts its predecessors left. Requests without a
    session and no admission limit: a new session is placed by the Lua's own count of active
    sessions, which a batch does not keep, and a batch admits against its snapshot."""
    rng, spread = random.Random(28), 0
    for index in range(CASES // 3):
        case = random_fleet(rng) | {"limit": None}
        pool = eligible(case["fleet"], case["min_version"], case["draining"])
        if not pool:
            continue
        requests = [
            GenerateRequest(
                f"q{i}",
                SamplingParams(),
                prompt_token_ids=[1],
                min_weight_version=case["min_version"],
            )
            for i in range(rng.randint(2, 8))
        ]
        snap = RegistrySnapshot(case["fleet"], dict(case["inflight"]), set(case["draining"]))
        plan = assign(requests, snap, case["cap"], Coin(case["coin"]))
        where = {r.request_id: rid for rid, group in plan.groups.items() for r in group}
        keys = Keys(f"{cluster_name}b{index}")
        await write_state(redis_client, keys, case, "")
        candidates = sorted(r.replica_id for r in pool)
        one_by_one = [
            await lua_enqueue(redis_client, keys, case, candidates, r.request_id, "")
            for r in requests
        ]
        assert one_by_one == [where[r.request_id] for r in requests], (index, case)
        spread += len(plan.groups) > 1
    assert spread  # some batches went to more than one replica
