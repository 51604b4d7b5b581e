"""The trainer's view of the other services: one object holding their clients.

Keeping the clients behind this small seam keeps ``Trainer`` free of addresses, API keys
and channel handling, and lets unit tests hand in in-process fakes.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.common.config import RlfleetConfig


@dataclass
class Fleet:
    rollout: object
    """Generates through the router (``generate(GenerateRequest) -> GenerateResult``)."""
    reward: object
    """``score_batch(list[ScoreRequest]) -> list[ScoreResult]``."""
    refcritic: object | None
    """``ref_logprobs`` / ``values`` / ``update_critic``; None when neither is needed."""
    weight_sync: object
    """``push(state_dict, version)``, ``wait_for_replicas``."""
    redis: object | None = None

    async def close(self) -> None:
        for client in (self.rollout, self.reward, self.refcritic, self.weight_sync):
            if client is not None:
                await client.close()
        if self.redis is not None:
            await self.redis.aclose()


async def connect_fleet(config: RlfleetConfig) -> Fleet:
    """Clients for the router, reward and refcritic; weight sync learns replicas from the router."""
    from rlfleet.refcritic.client import RefCriticClient
    from rlfleet.reward.client import RewardClient
    from rlfleet.rollout.client import RolloutClient
    from rlfleet.trainer.weight_sync import grpc_weight_sync

    key, mb = config.api_key, config.max_message_mb
    refcritic = (
        RefCriticClient(config.endpoints.refcritic, api_key=key) if config.needs_refcritic else None
    )
    return Fleet(
        rollout=RolloutClient(config.endpoints.router, api_key=key, max_message_mb=mb),
        reward=RewardClient(config.endpoints.reward, api_key=key),
        refcritic=refcritic,
        weight_sync=grpc_weight_sync(config.endpoints.router, key, mb),
    )
