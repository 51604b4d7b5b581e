"""Python client of the reward service: plain objects in and out, rlfleet errors on failure.

``RewardClient`` is async (the trainer's loop); ``SyncRewardClient`` wraps it for evaluation
scripts and notebooks that have no event loop. Failed calls raise ``InvalidArgument``,
``NotFound``, ``Unavailable``, ... (the gRPC error is the ``__cause__``), so callers never need
grpc themselves. Arguments are checked before anything is sent: something that is not a
ScoreRequest (or a dict of its fields) is a TypeError, a field of the wrong type an
InvalidArgument naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlfleet.common.errors import InvalidArgument
from rlfleet.common.grpc_client import ServiceClient, SyncServiceClient
from rlfleet.proto import common_pb2, reward_pb2, reward_pb2_grpc
from rlfleet.reward import convert as glue
from rlfleet.reward.types import ScoreRequest, ScoreResult, ScorerInfo, check_types

DEFAULT_TIMEOUT_S = 300.0


class RewardClient(ServiceClient):
    """Async client; use ``async with RewardClient(addr) as client`` or call ``close()``."""

    SERVICE = "reward"

    def __init__(
        self,
        address: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_mb: int = 64,
    ) -> None:
        super().__init__(address, api_key, timeout_s, max_message_mb)
        self._stub = reward_pb2_grpc.RewardStub(self._channel)

    async def score(self, request: ScoreRequest | dict[str, Any]) -> ScoreResult:
        """One item: a ScoreRequest, or a dict of its fields."""
        message = glue.request_to_proto(as_request(request, "score()"))
        reply = await self._call(self._stub.Score, message)
        return glue.result_from_proto(reply)

    async def score_batch(
        self, requests: Sequence[ScoreRequest | dict[str, Any]]
    ) -> list[ScoreResult]:
        """Results in the order of ``requests``; per-item failures are in ``result.error``."""
        if isinstance(requests, str | bytes | dict) or not isinstance(requests, Sequence):
            kind = type(requests).__name__
            raise TypeError(f"score_batch() takes a list of ScoreRequest, got {kind}")
        items = [as_request(r, f"score_batch() item {i}") for i, r in enumerate(requests)]
        message = reward_pb2.ScoreBatchRequest(requests=[glue.request_to_proto(r) for r in items])
        reply = await self._call(self._stub.ScoreBatch, message)
        return [glue.result_from_proto(item) for item in reply.results]

    async def list_scorers(self) -> list[ScorerInfo]:
        reply = await self._call(self._stub.ListScorers, common_pb2.Empty())
        return [glue.scorer_info_from_proto(info) for info in reply.scorers]


class SyncRewardClient(SyncServiceClient[RewardClient]):
    """``RewardClient``, blocking; not for use inside a running loop."""

    def __init__(self, address: str, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(lambda: RewardClient(address, api_key, **kwargs))

    def score(self, request: ScoreRequest | dict[str, Any]) -> ScoreResult:
        return self._run(self._client.score(request))

    def score_batch(self, requests: Sequence[ScoreRequest | dict[str, Any]]) -> list[ScoreResult]:
        return self._run(self._client.score_batch(requests))

    def list_scorers(self) -> list[ScorerInfo]:
        return self._run(self._client.list_scorers())


def as_request(item: Any, where: str) -> ScoreRequest:
    """A ScoreRequest checked before it is sent: TypeError for what is not one (nor a dict of
    its fields), InvalidArgument naming the field of a wrong type."""
    if isinstance(item, dict):
        item = ScoreRequest.from_dict(item)
    if not isinstance(item, ScoreRequest):
        raise TypeError(
            f"{where} takes a ScoreRequest (or a dict of its fields), got {type(item).__name__}"
        )
    try:
        check_types(item)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where} (id {item.id!r}): {exc}") from None
    return item
