"""Routing choice: least in-flight, sticky sessions with a load cap, version gating.

The rule lives twice, in ``routing.pick_replica`` (with ``admission.admit``) and in the
router's one-step enqueue Lua; the last test runs both on the same generated fleets against a
real Redis server and requires the same pick.
"""

from __future__ import annotations

import random
import time

import pytest
import redis.asyncio as aioredis

from rlfleet.common.errors import ResourceExhausted, Unavailable
from rlfleet.common.keys import Keys
from rlfleet.rollout.registry import RegistrySnapshot, ReplicaInfo
from rlfleet.rollout.router.admission import admit
from rlfleet.rollout.router.enqueue import Enqueuer, Placed, Placement
from rlfleet.rollout.router.routing import RoundRobin, eligible, loading, pick_replica, tie_break
from rlfleet.rollout.types import GenerateRequest, SamplingParams


def replica(rid: str, version: int = 0, state: str = "serving", alive: bool = True) -> ReplicaInfo:
    return ReplicaInfo(
        rid, f"127.0.0.1:{len(rid)}", weight_version=version, state=state, alive=alive
    )


def pick(candidates, inflight=None, sticky=None, min_version=0, cap=4, draining=(), seed=0):
    return pick_replica(
        candidates, inflight or {}, sticky, min_version, cap, draining, random.Random(seed)
    )


def test_least_inflight_wins():
    fleet = [replica("a"), replica("b"), replica("c")]
    assert pick(fleet, {"a": 3, "b": 1, "c": 2}) == "b"


def test_missing_or_negative_counts_mean_idle():
    fleet = [replica("a"), replica("b")]
    assert pick(fleet, {"a": 1, "b": -5}) == "b"
    assert pick(fleet, {"a": 1}) == "b"


def test_ties_spread_over_replicas_and_are_seed_deterministic():
    fleet = [replica("a"), replica("b")]
    picks = {pick(fleet, seed=seed) for seed in range(20)}
    assert picks == {"a", "b"}
    assert pick(fleet, seed=7) == pick(fleet, seed=7)


def test_sticky_replica_kept_even_when_busier():
    fleet = [replica("a"), replica("b")]
    assert pick(fleet, {"a": 3, "b": 0}, sticky="a", cap=4) == "a"


def test_sticky_broken_when_at_load_cap():
    fleet = [replica("a"), replica("b")]
    assert pick(fleet, {"a": 4, "b": 2}, sticky="a", cap=4) == "b"


def test_sticky_broken_when_dead():
    fleet = [replica("a", alive=False), replica("b")]
    assert pick(fleet, {"b": 3}, sticky="a") == "b"


def test_sticky_broken_when_below_version():
    fleet = [replica("a", version=1), replica("b", version=2)]
    assert pick(fleet, {"b": 3}, sticky="a", min_version=2) == "b"


def test_sticky_broken_when_draining():
    fleet = [replica("a"), replica("b")]
    assert pick(fleet, {"b": 3}, sticky="a", draining={"a"}) == "b"


def test_sticky_to_unknown_replica_falls_back():
    fleet = [replica("a"), replica("b")]
    assert pick(fleet, {"a": 2, "b": 1}, sticky="gone") == "b"


def test_version_gating_prefers_current_even_if_busier():
    fleet = [replica("old", version=3), replica("new", version=4)]
    assert pick(fleet, {"old": 0, "new": 9}, min_version=4, cap=100) == "new"


def test_not_serving_states_are_skipped():
    fleet = [replica("a", state="updating"), replica("b", state="paused"), replica("c")]
    assert pick(fleet, {"c": 50}, cap=100) == "c"


@pytest.mark.parametrize(
    ("fleet", "min_version", "draining", "reason"),
    [
        ([], 0, (), "no rollout replica is registered"),
        ([replica("a", alive=False)], 0, (), "heartbeats expired"),
        ([replica("a", state="updating")], 0, (), "states: updating"),
        ([replica("a", version=1), replica("b", version=2)], 5, (), "newest is 2"),
        ([replica("a"), replica("b")], 0, {"a", "b"}, "being drained"),
    ],
)
def test_none_eligible_raises_unavailable_with_reason(fleet, min_version, draining, reason):
    with pytest.raises(Unavailable, match=reason):
        pick(fleet, min_version=min_version, draining=draining)


def test_overloaded_fleet_still_routes_to_least_loaded():
    """The cap only breaks stickiness; it never refuses work."""
    fleet = [replica("a"), replica("b")]
    assert pick(fleet, {"a": 10, "b": 9}, sticky="a", cap=4) == "b"


def test_silent_replica_counts_as_loading_only_while_starting_recently():
    starting = replica("s", state="starting", alive=False)
    starting.heartbeat_at = time.time() - 30
    assert loading(starting)
    starting.heartbeat_at = time.time() - 3600
    assert not loading(starting)
    assert not loading(replica("x", state="serving", alive=False))


def test_round_robin_takes_eligible_replicas_in_turn_ignoring_load():
    rr, fleet = RoundRobin(), [replica("b"), replica("a"), replica("c", version=0)]
    assert [rr.pick(fleet, 0) for _ in range(4)] == ["a", "b", "c", "a"]
    assert [rr.pick(fleet, 0, draining={"b"}) for _ in range(2)] == ["a", "c"]
    with pytest.raises(Unavailable, match="version >= 1"):
        rr.pick(fleet, 1)


def test_a_coin_picks_among_ties_as_the_enqueue_lua_does() -> None:
    tied = ["a", "b", "c"]
    assert [tie_break(tied, coin) for coin in (0.0, 0.33, 0.34, 0.67, 0.999999)] == [
        "a", "a", "b", "c", "c"
    ]  # fmt: skip


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
    fleet = [replica(rid, rng.randint(0, 3), rng.choice(states), rng.random() < 0.85)
             for rid in ids]  # fmt: skip
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
        return pick_replica(snap.replicas, snap.inflight, case["sticky"], case["min_version"],
                            case["cap"], snap.draining, Coin(case["coin"]))  # fmt: skip
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
    request = GenerateRequest("q", SamplingParams(), prompt_token_ids=[1], session_id=session,
                              min_weight_version=case["min_version"])  # fmt: skip
    placement = Placement(case["cap"], case["limit"], 60.0, case["coin"])
    candidates = sorted(r.replica_id for r in pool)
    placed = await Enqueuer(redis, keys).enqueue(request, request.fingerprint(), "sub",
                                                 candidates, placement, 60)  # fmt: skip
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
