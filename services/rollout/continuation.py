"""Requests a weight update crosses: stopped where they are, continued under the new weights.

Why a module of its own: ``rollout.update_policy`` decides what an update does to the work in
flight, and three parts take part. The update (``InFlight.make_way`` / ``reopen``) closes and
opens the ``UpdateGate``; the engine stops whatever it is running (``Engine.interrupt``: the
requests come back with the tokens decoded so far and finish reason ``abort``); and every
request (``generate``) runs as *segments* through the gate. A segment is one engine call under
one weight version, so each of its tokens is stamped with that version.

- ``keep``: an interrupted sample is submitted again with its tokens so far appended to the
  prompt and ``max_tokens`` reduced by as many (``n = 1``; the samples of a request that were
  already finished stay as they are). Nothing decoded is sampled again; the prefix is only
  prefilled again under the new weights, so no token reads KV computed with the old ones.
  A sample whose budget ran out exactly at the update ends with ``length``. Stop strings are
  checked again over the joined tokens (one could straddle the boundary).
- ``restart``: an interrupted request is thrown away and raises ``RestartedByUpdate`` (a
  ``CancelledError``: the runner re-queues it like any request an update cancelled); its
  decoded tokens are counted in ``UpdateStats.tokens_discarded``.
- ``finish``: the gate never closes; the update waits for every request.

A seeded request continued under ``keep`` does not reproduce an uninterrupted run (the
continuation draws from a fresh generator); every other property holds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rlfleet.rollout.engines.base import tokens_until_stop
from rlfleet.rollout.types import Completion, SamplingParams

if TYPE_CHECKING:
    from rlfleet.rollout.engines.base import Engine


class RestartedByUpdate(asyncio.CancelledError):
    """An update under ``restart`` stopped this request; it runs again from scratch."""


@dataclass
class UpdateStats:
    """What weight updates did to requests in flight (the replica's counters)."""

    requests_resumed: int = 0
    """Samples continued after an update (``keep``), once per update they crossed."""
    tokens_kept: int = 0
    """Decoded tokens carried across an update instead of being sampled again."""
    requests_restarted: int = 0
    """Requests an update threw away to run again from scratch (``restart``, or ``keep``
    when the engine did not stop in time)."""
    tokens_discarded: int = 0
    """Decoded tokens those restarts threw away (0 under ``keep``)."""


class UpdateGate:
    """Open while requests may run on the engine; closed while an update swaps the weights.

    ``epoch`` goes up at every close, so a segment that started before a close and ended
    after it knows an update interrupted it. ``keeping`` says what such segments do."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._running = 0  # segments inside the engine now
        self.epoch = 0
        self.keeping = True
        self.stats = UpdateStats()

    @property
    def running(self) -> int:
        return self._running

    async def enter(self) -> int:
        """Wait until the gate is open, then count a segment in; returns the epoch."""
        while not self._open.is_set():  # re-checked: it may close again before we wake
            await self._open.wait()
        self._running += 1
        self._idle.clear()
        return self.epoch

    def leave(self) -> None:
        self._running -= 1
        if self._running == 0:
            self._idle.set()

    def close(self, keep: bool) -> None:
        """No segment starts until ``open``; running ones count as interrupted."""
        self._open.clear()
        self.epoch += 1
        self.keeping = keep

    def open(self) -> None:
        self._open.set()

    def interrupted(self, epoch: int) -> bool:
        return self.epoch != epoch

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no segment is inside the engine (True), or ``timeout_s`` (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return self._idle.is_set()


async def generate(
    gate: UpdateGate,
    engine: Engine,
    key: str,
    prompt: list[int],
    sampling: SamplingParams,
    version: Callable[[], int],
) -> list[Completion]:
    """``sampling.n`` completions of ``prompt``, every token stamped with its weight version,
    continued across updates as the module docstring says."""
    completions, interrupted = await _segment(gate, engine, key, prompt, sampling, version)
    if not interrupted:
        return completions
    _restart_unless_kept(gate, completions)
    return list(
        await asyncio.gather(
            *(
                _continue(gate, engine, f"{key}+{i}", prompt, sampling, version, c)
                for i, c in enumerate(completions)
            )
        )
    )


async def _continue(
    gate: UpdateGate,
    engine: Engine,
    key: str,
    prompt: list[int],
    sampling: SamplingParams,
    version: Callable[[], int],
    done: Completion,
) -> Completion:
    """One interrupted sample, continued until it finishes (it may cross several updates)."""
    part, interrupted = 0, True
    while interrupted and done.finish_reason == "abort":
        left = sampling.max_tokens - len(done.token_ids)
        if left <= 0:  # the update landed just as its budget ran out
            return replace(done, finish_reason="length")
        gate.stats.requests_resumed += 1
        gate.stats.tokens_kept += len(done.token_ids)
        part += 1
        step = replace(sampling, n=1, max_tokens=left)
        [more], interrupted = await _segment(
            gate, engine, f"{key}.{part}", prompt + done.token_ids, step, version
        )
        done = join(done, more, engine, sampling)
        if interrupted:
            _restart_unless_kept(gate, [done])
    return done


async def _segment(
    gate: UpdateGate,
    engine: Engine,
    key: str,
    prompt: list[int],
    sampling: SamplingParams,
    version: Callable[[], int],
) -> tuple[list[Completion], bool]:
    """One engine call under one version: (completions stamped with it, interrupted?)."""
    epoch = await gate.enter()
    try:
        at = version()  # cannot change while we are inside: an update waits for the gate
        completions = await engine.generate(key, prompt, sampling)
    finally:
        gate.leave()
    stamped = [replace(c, weight_versions=[at] * len(c.token_ids)) for c in completions]
    return stamped, gate.interrupted(epoch)


def _restart_unless_kept(gate: UpdateGate, completions: Sequence[Completion]) -> None:
    """Under ``restart``, throw the request away (counted) so it runs again from scratch."""
    if gate.keeping:
        return
    gate.stats.requests_restarted += 1
    gate.stats.tokens_discarded += sum(len(c.token_ids) for c in completions)
    raise RestartedByUpdate


def join(
    done: Completion, more: Completion, engine: Engine, sampling: SamplingParams
) -> Completion:
    """A sample's tokens so far followed by its continuation, cut again at a stop string
    (one may straddle the two), with the text decoded from all of them."""
    tokens = done.token_ids + more.token_ids
    logprobs = done.logprobs + more.logprobs
    versions = done.weight_versions + more.weight_versions
    reason = more.finish_reason
    if sampling.stop:
        decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        cut, hit = tokens_until_stop(tokens, decode, sampling.stop)
        if hit:
            tokens, reason = cut, "stop"
            logprobs, versions = logprobs[: len(cut)], versions[: len(cut)]
    text, _ = engine.decode(tokens, sampling.stop)
    return Completion(tokens, logprobs, text, reason, versions)


def oldest_version(completions: Sequence[Completion], default: int) -> int:
    """The oldest version among the tokens (what a result's ``weight_version`` reports);
    ``default`` when no token was sampled."""
    return min((v for c in completions for v in c.weight_versions), default=default)
