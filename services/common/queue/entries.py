"""What one stream entry holds, defined once for the Python that reads entries and for the Lua
that writes them (``xadd_lua``: the queue's scripts and the router's enqueue step).

An entry's fields: the request id, the payload, the deliveries it had before it was moved here
(``prior``), how many requests it holds (``n``, a packed entry holds several) and the tag of the
submission that queued it (``sub``, absent for a plain ``submit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from redis.typing import StreamRangeResponse

ID, PAYLOAD, PRIOR, WEIGHT, SUBMISSION = "id", "payload", "prior", "n", "sub"
"""The field names of an entry, in the order they are written."""

Entry = tuple[str, dict[bytes, bytes]]  # (entry id, fields) as read from the stream


def xadd_lua(
    stream: str, request_id: str, payload: str, prior: str, weight: str, submission: str = ""
) -> str:
    """The Lua call that queues one entry; each argument is a Lua expression (``KEYS[1]``,
    ``ARGV[2]``, ``"'0'"``); ``submission`` empty: the entry carries no tag."""
    fields = [(ID, request_id), (PAYLOAD, payload), (PRIOR, prior), (WEIGHT, weight)]
    if submission:
        fields.append((SUBMISSION, submission))
    pairs = ", ".join(f"'{name}', {value}" for name, value in fields)
    return f"redis.call('XADD', {stream}, '*', {pairs})"


@dataclass(frozen=True)
class Job:
    """One delivery of a request to a consumer; ``deliveries`` counts this one too (for a
    job taken out by ``Backlog.drain_jobs``: the deliveries so far, 0 if it was never read)."""

    entry_id: str
    request_id: str
    payload: bytes
    deliveries: int
    weight: int = 1
    """Requests the entry holds (a packed entry holds several; counted as in flight)."""
    submission: str = ""
    """Tag of the submission that queued it (``Producer.submit_bound``); travels with moves."""
    epoch: str = ""
    """The server's data epoch when it was read (``Answers.epoch``; "" unknown): an
    answer the fence refuses is still stored if the server lost its data since then."""


def job_of(entry_id: str, fields: dict[bytes, bytes], deliveries: int, epoch: str = "") -> Job:
    """The job an entry stands for, ``deliveries`` (from the group) plus its prior ones."""
    prior = int(fields.get(PRIOR.encode(), 0))
    weight = int(fields.get(WEIGHT.encode(), 1))
    submission = text(fields.get(SUBMISSION.encode(), b""))
    return Job(
        entry_id,
        request_id_of(fields),
        fields[PAYLOAD.encode()],
        deliveries + prior,
        weight,
        submission,
        epoch,
    )


def request_id_of(fields: dict[bytes, bytes]) -> str:
    """The request id an entry carries."""
    return text(fields[ID.encode()])


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream id as a sortable pair (ms, sequence)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def after(entry_id: str) -> str:
    """The smallest stream id greater than ``entry_id``."""
    ms, seq = id_key(entry_id)
    return f"{ms}-{seq + 1}"


def stream_entries(reply: Any) -> list[Entry]:
    """XREADGROUP's reply for one stream (a list; a dict with ``legacy_responses=False``)."""
    if not reply:
        return []
    per_stream = list(reply.values()) if isinstance(reply, dict) else [pair[1] for pair in reply]
    return range_entries(per_stream[0])


def range_entries(raw: StreamRangeResponse | None) -> list[Entry]:
    """Stream entries as read (XRANGE, one stream of XREADGROUP): ids as text; fields as the
    bytes of a client without ``decode_responses``, ``{}`` for an entry deleted meanwhile."""
    return [
        (text(eid), cast("dict[bytes, bytes]", fields or {}))
        for eid, fields in raw or ()
        if eid is not None
    ]
