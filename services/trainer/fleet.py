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


def needs_refcritic(config: RlfleetConfig) -> bool:
    return config.trainer.use_kl_loss or config.algorithm.adv_estimator == "gae"


async def connect_fleet(config: RlfleetConfig) -> Fleet:
    """Clients for the router, reward, refcritic and the replica registry."""
    from rlfleet.common.errors import FailedPrecondition
    from rlfleet.common.keys import Keys
    from rlfleet.common.redis_client import connect
    from rlfleet.refcritic.client import RefCriticClient
    from rlfleet.reward.client import RewardClient
    from rlfleet.rollout.client import RolloutClient
    from rlfleet.rollout.registry import ReplicaRegistry
    from rlfleet.trainer.weight_sync import WeightSync

    if not config.redis_url:
        raise FailedPrecondition("the trainer needs redis_url (RLFLEET_REDIS_URL) to find replicas")
    key, mb = config.api_key, config.max_message_mb
    redis = connect(config.redis_url)
    registry = ReplicaRegistry(redis, Keys(config.cluster), config.rollout.heartbeat_ttl_s)
    refcritic = (
        RefCriticClient(config.endpoints.refcritic, api_key=key)
        if needs_refcritic(config)
        else None
    )
    return Fleet(
        rollout=RolloutClient(config.endpoints.router, api_key=key, max_message_mb=mb),
        reward=RewardClient(config.endpoints.reward, api_key=key),
        refcritic=refcritic,
        weight_sync=WeightSync(
            registry,
            lambda address: RolloutClient(address, api_key=key, max_message_mb=mb),
            chunk_bytes=min(4, mb // 2) * 2**20,
        ),
        redis=redis,
    )
