"""What the refcritic serves, as its server and workers see it: two small Protocols.

Why Protocols and not the classes: ``RefPolicy`` and ``Critic`` import torch, and the gRPC
server, the queue path and the entry point must load without it (``--help`` is instant, tests
hand in plain fakes). Both models take plain lists of token ids and answer one list of floats
per response token (``Rows``), the shape the proto carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Rows = list[list[float]]
"""One float per response token, one list per sequence."""


class ReferenceModel(Protocol):
    """The frozen reference policy (``rlfleet.refcritic.reference.RefPolicy``)."""

    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> Rows: ...


class CriticModel(Protocol):
    """The trained critic (``rlfleet.refcritic.critic.Critic``); ``step`` counts its updates."""

    step: int

    def values(self, prompts: list[list[int]], responses: list[list[int]]) -> Rows: ...

    def update(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        returns: Rows,
        old_values: Rows,
        epochs: int | None = None,
        micro_batch_size: int | None = None,
    ) -> dict[str, float]: ...

    def save(self, path: str) -> str: ...

    def load(self, path: str) -> str: ...


@dataclass
class Models:
    """What this process loaded: the reference always, the critic unless disabled/worker-only."""

    reference: ReferenceModel
    critic: CriticModel | None
