"""The training clock of a run, which a resumed run carries on instead of starting again.

Why it lives in the checkpoint: a run killed after step M and resumed from its checkpoint at
step N < M is one run in two segments. Its summary must tell the run's story, not the second
segment's: held-out accuracy before the first step (not the checkpoint's), training time summed
over the segments, and when the target was first reached. The clock's ``state()`` is saved with
every checkpoint and ``restore``d from it. What a dead segment trained after its last checkpoint
is trained again, so its time counts once, in the segment that kept it.
"""

from __future__ import annotations

import time


class TrainingClock:
    """Training time with validation excluded, and when validation first reached the target.

    ``time_to_target_s`` runs from the start of the first step to the end of the step after
    which validation first showed ``>= target`` (what ``make run`` prints as
    ``time_to_0.85_s``). ``val_before`` is the held-out accuracy before the first step."""

    def __init__(self, target: float) -> None:
        self.target = target
        self.training_s = 0.0
        self.time_to_target_s: float | None = None
        self.val_before: dict[str, float] = {}
        self.restored = False
        """True when this clock goes on from a checkpoint's (a resumed run)."""
        self._started: float | None = None

    def begin(self) -> None:
        self._started = time.perf_counter()

    def pause(self) -> None:
        if self._started is not None:
            self.training_s += time.perf_counter() - self._started
            self._started = None

    def elapsed(self) -> float:
        """Training seconds so far, the running stretch included (for a checkpoint mid-loop)."""
        running = 0.0 if self._started is None else time.perf_counter() - self._started
        return self.training_s + running

    def observe(self, accuracy: float | None) -> None:
        if accuracy is not None and accuracy >= self.target and self.time_to_target_s is None:
            self.time_to_target_s = self.training_s

    def state(self) -> dict:
        """What a checkpoint keeps of the clock."""
        return {
            "training_s": self.elapsed(),
            "time_to_target_s": self.time_to_target_s,
            "val_before": dict(self.val_before),
        }

    def restore(self, state: dict) -> None:
        self.training_s = float(state["training_s"])
        self.time_to_target_s = state.get("time_to_target_s")
        self.val_before = dict(state.get("val_before", {}))
        self.restored = True
