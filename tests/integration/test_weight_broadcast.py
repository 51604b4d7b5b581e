"""Broadcast weight pushes (``trainer.weight_transport: broadcast``) to real replica processes
(``python -m rlfleet.rollout.main``, the tiny model, the transformers engine) on loopback: the
header over ``Rollout.UpdateWeights``, the bytes in one gloo collective from the trainer's
group (rank 0).

What is checked: two pushes (fp32, then bf16) reach both replicas on the group, the second on
the same epoch, and each replica then serves the greedy tokens the actor gives with the pushed
weights; with one replica SIGKILLed before a push, the push still lands on the other within a
bound (the round is aborted at once: the dead one never says it is ready; the live one is
streamed the update), the dead one counts as failed, both as fallbacks, and the next push, the
dead one sitting out, streams to the live one alone. The trainer's planning (members, epochs,
who sits out) is in tests/unit/test_weight_broadcast_plan.py.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from replica_proc import MODEL, ReplicaProc, replicas_started, start_replica, stop_replica
from replica_weights import original_weights

from rlfleet.common.keys import Keys
from rlfleet.common.redis_server import EmbeddedRedis
from rlfleet.rollout.client import PreparedUpdate, RolloutClient
from rlfleet.rollout.types import GenerateRequest, ReplicaStatus, SamplingParams
from rlfleet.trainer.weight_broadcast import BroadcastWeightTransport
from rlfleet.trainer.weight_sync import WeightSync

PROMPTS = ["12+34=", "57+18=", "90+9="]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
TIMEOUT_S = 10.0  # the group's: joining, the handshake, the collective
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="tiny model not built"),
]


@pytest.fixture(scope="module")
def pair(redis_server: EmbeddedRedis, tmp_path_factory) -> Iterator[list[ReplicaProc]]:
    cluster = Keys(f"t{uuid.uuid4().hex[:12]}")
    logs = tmp_path_factory.mktemp("broadcast")
    with replicas_started(redis_server.url, cluster, ("r-a", "r-b"), logs) as up:
        yield up


class Listed:
    """The replicas a push goes to, as the router would list them (a dead one still listed)."""

    def __init__(self, replicas: list[ReplicaProc]) -> None:
        self.replicas = replicas
        self.clients = [RolloutClient(r.address) for r in replicas]
        self.last: dict[str, ReplicaStatus] = {}

    async def list_replicas(self) -> list[ReplicaStatus]:
        answers = await asyncio.gather(*(c.status() for c in self.clients), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, ReplicaStatus):
                self.last[answer.replica_id] = answer
        return [self.last[r.replica_id] for r in self.replicas]

    async def close(self) -> None:
        for client in self.clients:
            await client.close()


def broadcast_sync(replicas: list[ReplicaProc]) -> WeightSync:
    transport = BroadcastWeightTransport(RolloutClient, PreparedUpdate.of, 2**20, TIMEOUT_S)
    return WeightSync(Listed(replicas), transport)


def moved(scale: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tiny model's weights, matrices scaled, in ``dtype``."""
    return {
        name: (t * scale if t.dim() == 2 else t).to(dtype) for name, t in original_weights().items()
    }


def actor_greedy(state: dict[str, torch.Tensor]) -> list[list[int]]:
    """The greedy tokens of the actor holding ``state`` (a transformers model, in fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            tokens = model.generate(ids, do_sample=False, max_new_tokens=GREEDY.max_tokens)
        out.append(tokens[0, ids.shape[1] :].tolist())
    return out


async def served_greedy(address: str, version: int) -> list[list[int]]:
    async with RolloutClient(address) as client:
        requests = [
            GenerateRequest(uuid.uuid4().hex, GREEDY, prompt_text=p, min_weight_version=version)
            for p in PROMPTS
        ]
        results = await asyncio.gather(*(client.generate(r, timeout_s=60) for r in requests))
    assert {r.weight_version for r in results} == {version}
    return [r.completions[0].token_ids for r in results]


def same_tokens(served: list[list[int]], actor: list[list[int]]) -> bool:
    """Equal up to where the replica stopped (it may stop at the end-of-sequence token)."""
    return all(a[: len(s)] == s and s for s, a in zip(served, actor, strict=True))


async def test_two_pushes_on_the_group_serve_the_actors_tokens(pair: list[ReplicaProc]) -> None:
    sync = broadcast_sync(pair)
    try:
        base = max(s.weight_version for s in await sync._directory.list_replicas())
        for step, (scale, dtype) in enumerate([(0.9, torch.float32), (1.1, torch.bfloat16)]):
            state, version = moved(scale, dtype), base + step + 1
            metrics = await sync.push(state, version)
            assert metrics["weight_sync/replicas"] == 2.0, metrics
            assert metrics["weight/broadcast_fallbacks"] == 0.0, metrics
            actor = actor_greedy(state)
            for replica in pair:
                assert same_tokens(await served_greedy(replica.address, version), actor)
        assert sync._transport._group.epoch == 1  # the second push reused the group
    finally:
        await sync.close()


async def test_a_dead_member_does_not_hold_the_push(
    pair: list[ReplicaProc], redis_server: EmbeddedRedis, tmp_path
) -> None:
    doomed = start_replica(redis_server.url, pair[0].keys, "r-dead", tmp_path / "dead.log")
    replicas = [pair[0], doomed]
    sync = broadcast_sync(replicas)
    try:
        base = max(s.weight_version for s in await sync._directory.list_replicas())
        assert (await sync.push(moved(0.95, torch.float32), base + 1))[
            "weight/broadcast_fallbacks"
        ] == 0.0
        doomed.proc.kill()  # SIGKILL, before the next push
        doomed.proc.wait(30)
        started = time.monotonic()
        state = moved(1.05, torch.float32)
        metrics = await asyncio.wait_for(sync.push(state, base + 2), 60)
        assert time.monotonic() - started < TIMEOUT_S  # aborted at once, not at the deadline
        assert metrics["weight_sync/replicas"] == 1.0 and metrics["weight_sync/failed"] == 1.0
        assert metrics["weight/broadcast_fallbacks"] == 2.0, metrics
        assert same_tokens(await served_greedy(pair[0].address, base + 2), actor_greedy(state))
        metrics = await asyncio.wait_for(sync.push(moved(1.0, torch.float32), base + 3), 60)
        assert metrics["weight_sync/replicas"] == 1.0 and metrics["weight/broadcast_fallbacks"] == 0
    finally:
        await sync.close()
        stop_replica(doomed, signal.SIGKILL)
