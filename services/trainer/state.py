"""The trainer's life cycle, as ``Trainer.state`` holds it and ``Trainer.GetStatus`` reports it.

A ``StrEnum``: it travels as its value (``TrainerStatus.state`` in trainer.proto), and only the
states listed here are ever set, so the proto's comment can list exactly these.
"""

from __future__ import annotations

import enum


class TrainerState(enum.StrEnum):
    STARTING = "starting"  # waiting for replicas, pushing the first weights
    RUNNING = "running"  # training steps
    PAUSED = "paused"  # between steps, until Resume
    DONE = "done"  # the run finished (final validation and checkpoint written)
