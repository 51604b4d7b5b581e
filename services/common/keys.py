"""Every Redis key name rlfleet uses, in one place.

Several runs may share one Redis server, so every key lives under ``rlfleet:<cluster>:``.
Building names here (and nowhere else) keeps the layout greppable and stops two roles from
disagreeing about a key's spelling. All methods are pure: they only format strings.

Layout (``P`` = ``rlfleet:<cluster>``)::

    P:replicas                     set   ids of registered rollout replicas
    P:replica:<id>                 hash  a replica's address, weight version, state
    P:replica:<id>:heartbeat       str   liveness marker, expires (TTL) when a replica dies
    P:sticky:<session>             str   session -> replica id, with TTL
    P:inflight                     hash  replica id -> requests in flight
    P:stream:rollout:<id>          stream  one replica's generation requests
    P:stream:reward                stream  scoring jobs
    P:stream:refcritic             stream  reference log-prob / value jobs
    P:stream:env                   stream  episode jobs
    P:result:<request id>          str   the one answer to a request (with TTL)
    P:notify:<request id>          list  wake-up tokens for waiters on that result
    P:request:<request id>         str   fingerprint the request id is bound to (with TTL)
    P:cancel:<request id>          str   submission whose callers all gave up (with TTL)
    P:waiters:<request id>         str   callers waiting on a request now (with TTL)
    <stream>:dead                  stream  entries given up on after too many deliveries
    <stream>:waiting               zset  consumers waiting for work (member) since (ms)
    P:lock:janitor                 str   lock held by whoever migrates dead replicas' work
    P:draining                     set   replica ids that routers no longer send new work to
    P:epoch                        str   token set once per server data set (never expires)
"""

from __future__ import annotations

from dataclasses import dataclass

_FORBIDDEN = set(": \t\r\n{}")

# Consumer group of each kind of stream: every producer and consumer of a stream must agree.
ROLLOUT_GROUP = "rollout"  # each replica's request stream, read by that replica
REWARD_GROUP = "reward"  # the scoring stream, read by every reward worker
REFCRITIC_GROUP = "refcritic"  # both refcritic streams (ref, values)
ENV_GROUP = "env"  # the episode stream, read by every env worker

HEARTBEAT_SUFFIX = ":heartbeat"  # ``Keys.heartbeat`` is the replica's key plus this


def _check_part(kind: str, value: str) -> str:
    """Reject names that would blur the namespace (``a:b`` could alias another key)."""
    if not value or _FORBIDDEN & set(value):
        raise ValueError(f"invalid {kind} {value!r}: must be non-empty, no ':', '{{}}' or spaces")
    return value


@dataclass(frozen=True)
class Keys:
    """Key names for one cluster (one training run or one deployment)."""

    cluster: str

    def __post_init__(self) -> None:
        _check_part("cluster name", self.cluster)

    @property
    def prefix(self) -> str:
        """Common prefix of every key of this cluster; ``SCAN prefix:*`` finds them all."""
        return f"rlfleet:{self.cluster}"

    @property
    def replicas(self) -> str:
        """Set of registered replica ids (membership, not liveness: see ``heartbeat``)."""
        return f"{self.prefix}:replicas"

    @property
    def replica_prefix(self) -> str:
        """``replica`` without the id: Lua scripts append the id they picked."""
        return f"{self.prefix}:replica:"

    def replica(self, replica_id: str) -> str:
        """Hash describing one replica: address, weight version, state."""
        return self.replica_prefix + _check_part("replica id", replica_id)

    def heartbeat(self, replica_id: str) -> str:
        """Key a live replica keeps refreshing with a TTL; its absence means the replica died."""
        return self.replica(replica_id) + HEARTBEAT_SUFFIX

    def sticky(self, session_id: str) -> str:
        """Session -> replica id, so one GRPO group or conversation keeps its prefix cache.

        Session ids come from users, so they are not validated beyond being non-empty.
        """
        if not session_id:
            raise ValueError("empty session id")
        return f"{self.prefix}:sticky:{session_id}"

    @property
    def pinned_prefix(self) -> str:
        """``pinned`` without the id: Lua scripts append the id they picked."""
        return f"{self.prefix}:pinned:"

    def pinned(self, replica_id: str) -> str:
        """Sorted set of the sessions pinned to one replica (member: the session's ``sticky``
        key; score: when the pin expires, in ms), so new sessions spread by session count."""
        return self.pinned_prefix + _check_part("replica id", replica_id)

    @property
    def inflight(self) -> str:
        """Hash replica id -> number of requests in flight, for least-loaded routing."""
        return f"{self.prefix}:inflight"

    @property
    def rollout_stream_prefix(self) -> str:
        """``rollout_stream`` without the id: Lua scripts append the id they picked, and a scan
        for ``prefix*`` finds every replica's stream (and its dead-letter stream)."""
        return f"{self.prefix}:stream:rollout:"

    def rollout_stream(self, replica_id: str) -> str:
        """Request stream of one rollout replica (the router picks the replica)."""
        return self.rollout_stream_prefix + _check_part("replica id", replica_id)

    @property
    def reward_stream(self) -> str:
        """Scoring jobs, shared by every reward worker."""
        return f"{self.prefix}:stream:reward"

    @property
    def refcritic_stream(self) -> str:
        """Reference log-prob jobs, read by every refcritic process (workers scale out)."""
        return f"{self.prefix}:stream:refcritic"

    @property
    def refcritic_values_stream(self) -> str:
        """Value jobs, read only by the process holding the trained critic (one writer)."""
        return f"{self.prefix}:stream:refcritic:values"

    @property
    def env_stream(self) -> str:
        """Episode jobs, shared by every env worker (one entry per episode)."""
        return f"{self.prefix}:stream:env"

    def result(self, request_id: str) -> str:
        """The stored answer to a request; request ids must be unique within the cluster."""
        return f"{self.prefix}:result:{_request(request_id)}"

    def request(self, request_id: str) -> str:
        """A request id's binding to its content (a fingerprint), so a reused id with other
        content is refused and a repeated one is queued once (TTL: the result's)."""
        return f"{self.prefix}:request:{_request(request_id)}"

    def cancel(self, request_id: str) -> str:
        """Marks one submission of a request as given up by its callers (its consumer aborts it)."""
        return f"{self.prefix}:cancel:{_request(request_id)}"

    def waiters(self, request_id: str) -> str:
        """How many callers wait on a request right now (the last to give up cancels it)."""
        return f"{self.prefix}:waiters:{_request(request_id)}"

    def notify(self, request_id: str) -> str:
        """List a completer pushes to so that waiters blocked in BLPOP wake up at once."""
        return f"{self.prefix}:notify:{_request(request_id)}"

    def dead_letter(self, stream: str) -> str:
        """Where a stream's poison entries go; only streams of this cluster have one."""
        if not stream.startswith(self.prefix + ":stream:"):
            raise ValueError(f"stream {stream!r} is not a stream of cluster {self.cluster!r}")
        return f"{stream}:dead"

    def waiting(self, stream: str) -> str:
        """Consumers of a stream waiting for work now, each marked by itself (``WaitingBoard``)."""
        return self.dead_letter(stream).removesuffix(":dead") + ":waiting"

    @property
    def janitor_lock(self) -> str:
        """Lock so only one process at a time migrates a dead replica's queued work."""
        return f"{self.prefix}:lock:janitor"

    @property
    def draining(self) -> str:
        """Set of replica ids being drained: routers send them no new work, they finish their queue."""
        return f"{self.prefix}:draining"

    @property
    def epoch(self) -> str:
        """A token written once (``SET NX``) and never expired: a different value, or none,
        means the server lost its data (an empty restart, a flush) since it was read."""
        return f"{self.prefix}:epoch"


def _request(request_id: str) -> str:
    """Request ids are caller-chosen; they only need to be non-empty and single-line."""
    if not request_id or "\n" in request_id:
        raise ValueError(f"invalid request id {request_id!r}")
    return request_id
