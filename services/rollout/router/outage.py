"""How the router's waits ride out a Redis outage or an empty Redis restart.

Why: a request that arrives while Redis is down sits in its client's retries
(``redis_client.OutageRetry``, up to ``OUTAGE_BUDGET_S``) until the server is back. If the
server came back empty, the replicas are not registered again until their next heartbeat, so
a route wait that started when the request arrived would already be spent: the request would
fail UNAVAILABLE although replicas are about to be there. So the route wait
(``router.route_wait_s``) starts again after any Redis call that sat out an outage.
"""

from __future__ import annotations

OUTAGE_S = 1.0
"""A routing attempt that took this long sat out an outage (a normal one takes milliseconds)."""


def route_give_up(
    give_up: float, started: float, now: float, route_wait_s: float, deadline: float
) -> float:
    """When to stop waiting for an eligible replica, after an attempt from ``started`` to
    ``now``: unchanged, or ``route_wait_s`` from now when the attempt sat out an outage (never
    past the request's ``deadline``)."""
    if now - started < OUTAGE_S:
        return give_up
    return min(deadline, max(give_up, now + route_wait_s))
