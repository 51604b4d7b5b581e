"""Routing choice: least in-flight, sticky sessions with a load cap, version gating.

The rule lives twice, in ``routing.pick_replica`` (with ``admission.admit``) and in the
router's one-step enqueue Lua; tests/integration/test_routing_lua_parity.py runs both on the
same generated fleets against a real Redis server and requires the same pick.
"""

from __future__ import annotations

import random
import time

import pytest

from rlfleet.common.errors import Unavailable
from rlfleet.rollout.registry import ReplicaInfo
from rlfleet.rollout.router.routing import RoundRobin, loading, pick_replica, tie_break


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
        "a",
        "a",
        "b",
        "c",
        "c",
    ]
