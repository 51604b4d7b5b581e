"""A replica's part in a relayed weight push (``trainer.weight_transport: relay``): forward
the update, chunk by chunk as it arrives, to the replicas its header names, and report what
each of them (and everything below them) made of it.

Why forward while receiving: a replica that waited for its whole payload before forwarding
would add one full transfer per level of the tree; forwarding each chunk as it lands makes the
levels overlap, so a tree of depth d costs about one transfer plus d chunk times. The chunks
forwarded are the very messages received (``WeightChunk`` data, already serialized: no copy);
only the header is rewritten, to name the receiver's own subtree.

What can go wrong, and what each replica then does:

- The bytes from above stop (the trainer or this replica's parent died, or sent less than
  announced): every forward is cancelled, so no child gets a complete payload; nothing is
  applied anywhere below.
- A child dies, or refuses (its own header checks): its forward stops, the others go on; its
  failure is reported (``RelayResult``), and so is nothing for its subtree (the trainer pushes
  to every replica it has no success for, straight: ``weight/relay_fallbacks``).
- Every replica verifies what it received against the header's checksum before applying it
  (the normal update path), so a parent cannot hand a child a mix of two versions.

The replica answers its own sender only after every child answered, so the answer carries the
whole subtree's results (``UpdateOutcome.relayed``). Children are dialled at their registered
address with this replica's API key and message limit (TLS as the process is set up).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from rlfleet.common.config import RlfleetConfig
from rlfleet.model import weights
from rlfleet.model.weights_relay import RelayResult, RelayTarget
from rlfleet.rollout.client import RolloutClient, header_message

log = logging.getLogger(__name__)

QUEUE_MESSAGES = 4
"""Chunks held for a child that reads slower than we receive (4 MiB each), before receiving
waits for it: a slow child slows its subtree's sender, it does not fill memory."""


class RelayLinks:
    """Clients to the replicas this one forwards to, one per address, kept for the life of the
    process (a relay tree names the same replicas push after push)."""

    def __init__(self, connect: Callable[[str], RolloutClient], delay_s: float = 0.0) -> None:
        self._connect, self._delay_s = connect, delay_s
        self._clients: dict[str, RolloutClient] = {}

    def start(self, header: weights.WeightHeader) -> Relay | None:
        """Open a forward to every child the header names (None when it names none)."""
        if not header.relay:
            return None
        children = [_Forward(self._client(t.address), t, header) for t in header.relay]
        names = ", ".join(t.replica_id for t in header.relay)
        log.info("relaying weights v%d to %s", header.version, names)
        return Relay(children, self._delay_s)

    def _client(self, address: str) -> RolloutClient:
        if address not in self._clients:
            self._clients[address] = self._connect(address)
        return self._clients[address]


def relay_links(config: RlfleetConfig) -> RelayLinks:
    """Links dialled with this replica's API key and message limit."""

    def connect(address: str) -> RolloutClient:
        return RolloutClient(address, api_key=config.api_key, max_message_mb=config.max_message_mb)

    return RelayLinks(connect, config.rollout.debug_relay_delay_s)


class Relay:
    """The forwards of one update: ``forward`` each message received, then ``finish`` (or
    ``abort`` when the update could not be received whole)."""

    def __init__(self, children: list[_Forward], delay_s: float) -> None:
        self._children, self._delay_s = children, delay_s

    async def forward(self, message: bytes) -> None:
        """One serialized data message to every child still taking it."""
        for child in self._children:
            await child.put(message)
        if self._delay_s:  # rollout.debug_relay_delay_s: a test kills us mid-forward
            await asyncio.sleep(self._delay_s)

    async def finish(self) -> list[RelayResult]:
        """Wait for every child's answer: its result and those of its subtree."""
        answers = await asyncio.gather(*(child.finish() for child in self._children))
        return [result for answer in answers for result in answer]

    def abort(self) -> None:
        """Cancel every forward: no child may get (and apply) a part of an update."""
        for child in self._children:
            child.call.cancel()


class _Forward:
    """One child's update stream: our header for it, then the data messages we put."""

    def __init__(self, client: RolloutClient, target: RelayTarget, header: weights.WeightHeader):
        self.target = target
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_MESSAGES)
        first = header_message(replace(header, relay=target.children))
        self.call = asyncio.ensure_future(client.push_messages(self._messages(first)))

    async def _messages(self, first: bytes) -> AsyncIterator[bytes]:
        yield first
        while (message := await self._queue.get()) is not None:
            yield message

    async def put(self, message: bytes | None) -> None:
        """Queue a message; dropped once the child's call ended (it died or refused)."""
        if self.call.done():
            return
        if not self._queue.full():
            self._queue.put_nowait(message)
            return
        waiting = asyncio.ensure_future(self._queue.put(message))
        await asyncio.wait((waiting, self.call), return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            waiting.cancel()

    async def finish(self) -> list[RelayResult]:
        await self.put(None)
        try:
            outcome = await self.call
        except Exception as exc:  # noqa: BLE001 - one child's failure is reported, not raised
            log.warning("relay to %s failed: %s", self.target.replica_id, exc)
            return [
                RelayResult(self.target.replica_id, False, error=f"{type(exc).__name__}: {exc}")
            ]
        mine = RelayResult(
            self.target.replica_id, True, outcome.version, pause_seconds=outcome.pause_seconds
        )
        return [mine, *outcome.relayed]
