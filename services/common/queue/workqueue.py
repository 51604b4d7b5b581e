"""Every side of one work-queue stream on one object, for code that plays all its parts.

Roles take the side they use (``rlfleet.common.queue``: ``Producer``, ``Consumer``,
``Backlog``; the design is described there). This union serves what stands on both ends of
one stream: tests and tools that queue and consume, and the router, which produces to its
replicas' streams and rescues their backlogs. The names below are re-exported so that such
code imports the queue from one place.
"""

from __future__ import annotations

from rlfleet.common.queue.answers import carried_answer
from rlfleet.common.queue.backlog import Backlog
from rlfleet.common.queue.consumer import Consumer, Finish
from rlfleet.common.queue.entries import Job
from rlfleet.common.queue.producer import Bound, Producer
from rlfleet.common.queue.results import Failure, Result, encode_result

__all__ = [
    "Bound",
    "Failure",
    "Finish",
    "Job",
    "Result",
    "WorkQueue",
    "carried_answer",
    "encode_result",
]


class WorkQueue(Producer, Consumer, Backlog):
    """Producer, consumer and backlog of one stream, read by one consumer group."""
