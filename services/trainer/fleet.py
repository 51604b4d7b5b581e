"""The trainer's view of the other services: one object holding their clients.

Keeping the clients behind this small seam keeps ``Trainer`` free of addresses, API keys
and channel handling, and lets unit tests hand in in-process fakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from rlfleet.common.config import RlfleetConfig
from rlfleet.trainer.episodes import EpisodeSource

if TYPE_CHECKING:
    from rlfleet.refcritic.client import CheckpointInfo
    from rlfleet.reward.types import ScoreRequest, ScoreResult
    from rlfleet.rollout.types import GenerateRequest, GenerateResult, ReplicaStatus
    from rlfleet.trainer.weight_check import ReplicaProbe


class Closable(Protocol):
    async def close(self) -> None: ...


class Generator(Closable, Protocol):
    """The router's generation API (``rlfleet.rollout.client.RolloutClient``)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]: ...


class ScoreService(Closable, Protocol):
    """The reward service (``rlfleet.reward.client.RewardClient``), not one of its scorers."""

    async def score_batch(self, requests: list[ScoreRequest]) -> list[ScoreResult]: ...


class RefCritic(Closable, Protocol):
    """Reference log-probs, critic values and critic updates (``RefCriticClient``)."""

    async def ref_logprobs(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]: ...

    async def values(
        self, prompts: list[list[int]], responses: list[list[int]]
    ) -> list[list[float]]: ...

    async def update_critic(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        returns: list[list[float]],
        old_values: list[list[float]],
    ) -> dict[str, float]: ...

    async def save_checkpoint(self, path: str) -> CheckpointInfo:
        """The critic's weights, optimizer and step into ``path`` (on the refcritic's host)."""
        ...

    async def load_checkpoint(self, path: str) -> CheckpointInfo: ...


class WeightSnapshot(Protocol):
    """One version of the weights, copied: pushed as often as retries need, then closed."""

    async def push(self, only_stale: bool = False) -> dict[str, float]: ...

    def close(self) -> None: ...


class ClonedSnapshot:
    """A snapshot by cloning every tensor (the default of publishers that encode nothing)."""

    def __init__(
        self, publisher: WeightPublisher, state_dict: dict, version: int, flush_cache: bool
    ) -> None:
        self._publisher, self._version, self._flush = publisher, version, flush_cache
        self._state = {name: tensor.clone() for name, tensor in state_dict.items()}

    async def push(self, only_stale: bool = False) -> dict[str, float]:
        return await self._publisher.push(self._state, self._version, self._flush, only_stale)

    def close(self) -> None:
        self._state = {}


class WeightPublisher(Closable, Protocol):
    """Pushes the actor's weights to the replicas (``rlfleet.trainer.weight_sync.WeightSync``)."""

    async def push(
        self, state_dict: dict, version: int, flush_cache: bool = True, only_stale: bool = False
    ) -> dict[str, float]: ...

    async def snapshot(
        self, state_dict: dict, version: int, flush_cache: bool = True
    ) -> WeightSnapshot:
        """``state_dict`` as ``version``, copied so the actor may train on while it is
        pushed (async mode). ``WeightSync`` encodes it straight into the payload replicas
        read (one copy, not two); this default clones it."""
        return ClonedSnapshot(self, state_dict, version, flush_cache)

    async def wait_for_replicas(self, count: int, timeout_s: float) -> list[ReplicaStatus]: ...


@dataclass
class Fleet:
    """What the trainer needs of the other services, each behind a small Protocol."""

    rollout: Generator
    reward: ScoreService
    refcritic: RefCritic | None
    """None when the config needs neither a reference nor a critic."""
    weight_sync: WeightPublisher
    env: EpisodeSource | None = None
    """The env service, in agent mode only (``agent.env`` set)."""
    probe: ReplicaProbe | None = None
    """Replicas asked one by one, for ``trainer.weight_check`` only."""

    def needed_refcritic(self) -> RefCritic:
        """``refcritic``, for a config with a reference or a critic (``connect_fleet`` then
        connects one: its absence is a wiring error, not a state to handle)."""
        if self.refcritic is None:
            raise RuntimeError(
                "the config needs a refcritic (a reference or a critic), the fleet has none"
            )
        return self.refcritic

    def needed_env(self) -> EpisodeSource:
        """``env``, in agent mode (``agent.env`` set: ``connect_fleet`` then connects one)."""
        if self.env is None:
            raise RuntimeError("agent mode needs the env service; the fleet has none")
        return self.env

    async def close(self) -> None:
        clients = (self.rollout, self.reward, self.refcritic, self.weight_sync, self.env)
        for client in (*clients, self.probe):
            if client is not None:
                await client.close()


async def connect_fleet(config: RlfleetConfig) -> Fleet:
    """Clients for the router, reward and refcritic; weight sync learns replicas from the router."""
    from rlfleet.env.client import EnvClient
    from rlfleet.refcritic.client import RefCriticClient
    from rlfleet.reward.client import RewardClient
    from rlfleet.rollout.client import RolloutClient
    from rlfleet.trainer.replica_probe import GrpcReplicaProbe
    from rlfleet.trainer.weight_sync import grpc_weight_sync

    key, mb = config.api_key, config.max_message_mb
    refcritic = (
        RefCriticClient(config.endpoints.refcritic, api_key=key) if config.needs_refcritic else None
    )
    return Fleet(
        rollout=RolloutClient(config.endpoints.router, api_key=key, max_message_mb=mb),
        reward=RewardClient(config.endpoints.reward, api_key=key),
        refcritic=refcritic,
        weight_sync=grpc_weight_sync(
            config.endpoints.router,
            key,
            mb,
            config.trainer.weight_shared_memory,
            config.trainer.weight_delta,
            config.trainer.weight_transport,
            config.trainer.relay_fanout,
            config.trainer.weight_broadcast_timeout_s,
        ),
        env=EnvClient(
            config.agent.address,
            api_key=key,
            timeout_s=config.agent.request_timeout_s,
            max_message_mb=mb,
        )
        if config.agent.env
        else None,
        probe=GrpcReplicaProbe(config.endpoints.router, key, mb)
        if config.trainer.weight_check.enable
        else None,
    )
