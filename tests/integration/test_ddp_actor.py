"""The data-parallel actor (``trainer.strategy: ddp``) on a real local Ray cluster.

Two gloo ranks (Ray worker processes) against the single-process ``Actor`` on the same batch:
the gradients and the updated weights agree to float32 rounding. Then the controller loop runs
three steps with the DDP actor behind in-process fakes of the other services, pushing rank 0's
weights, and a checkpoint written from rank 0 loads into a single-process actor.

One Ray cluster (2 CPUs) and one worker group serve the whole module: starting them is most of
its time on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections.abc import Mapping

import pytest
import torch
from tiny_models import random_qwen2

from rlfleet.common.config import load_config
from rlfleet.reward.types import ScoreRequest, ScoreResult
from rlfleet.rollout.types import Completion, GenerateRequest, GenerateResult, ReplicaStatus
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.data import PromptRecord
from rlfleet.trainer.fleet import Fleet, Generator, ScoreService, WeightPublisher
from rlfleet.trainer.loggers import StepWriter
from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask
from rlfleet.trainer.trainer import Trainer

pytestmark = pytest.mark.slow

VOCAB = 16
TOLERANCE = 1e-5
"""Max abs difference allowed between the DDP and the single-process results (float32; the
two differ only in summation order: two half-batch gradients all-reduced vs one batch)."""

SETTINGS = {
    "trainer.lr": 5e-3,
    "trainer.use_kl_loss": "false",
    "rollout.max_tokens": 4,
    "rollout.n": 4,
    "data.train_batch_size": 2,
    "trainer.ppo_mini_batch_size": 4,
    "trainer.ppo_epochs": 2,
}


def config_for(strategy: str, **extra):
    items = {**SETTINGS, "trainer.strategy": strategy, **extra}
    if strategy == "ddp":
        items["trainer.world_size"] = 2
    return load_config(None, [f"{k}={v}" for k, v in items.items()], env={})


def tiny_model():
    return random_qwen2(hidden=32, layers=1, heads=2, kv_heads=1, vocab=VOCAB)


@pytest.fixture(scope="module")
def ddp_actor():
    """One local Ray cluster and one 2-rank DDP actor for the module; both stopped at the end."""
    ray = pytest.importorskip("ray")
    from rlfleet.trainer.ddp import parallel_actor

    # A session folder of our own: /tmp/ray's "current cluster" stays other runs' business.
    temp = tempfile.mkdtemp(prefix="rlf-ddp-", dir="/tmp")
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=100 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp,
    )
    actor = None
    try:
        actor = parallel_actor(config_for("ddp"), tiny_model(), pad_id=0)
        yield actor
    finally:
        if actor is not None:
            actor.close()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def single_copy_of(ddp_actor) -> Actor:
    """A single-process actor holding rank 0's weights and optimizer state."""
    model = tiny_model()
    model.load_state_dict(ddp_actor.model.state_dict())
    actor = Actor(config_for("single"), model, pad_id=0)
    actor.apply_training_state(ddp_actor.group.call_rank0("training_state"))
    return actor


def make_batch(seed: int, live_rows: list[int] | None = None):
    """8 sequences of uneven prompt/response lengths; per-row advantages, zero on two rows (or
    on every row but ``live_rows``) so the zero-advantage skip is exercised."""
    rng = random.Random(seed)
    batch = RolloutBatch(
        prompts=[[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 5))] for _ in range(8)],
        responses=[[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(8)],
    )
    mask = response_mask(batch.response_lengths())
    values = [rng.uniform(-1, 1) for _ in range(8)]
    live = set(live_rows) if live_rows is not None else {0, 1, 2, 4, 5, 7}
    advantages = torch.tensor([v if i in live else 0.0 for i, v in enumerate(values)])
    return batch, advantages[:, None] * mask, mask


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a)


def update_both(ddp_actor, seed: int, live_rows=None):
    single = single_copy_of(ddp_actor)
    batch, advantages, mask = make_batch(seed, live_rows)
    torch.manual_seed(seed)  # both draw the epochs' row orders from the caller's RNG
    expected = single.update(batch, advantages, mask)
    torch.manual_seed(seed)
    got = ddp_actor.update(batch, advantages, mask)
    return single, expected, got


def test_two_ranks_match_the_single_process_update(ddp_actor):
    single, expected, got = update_both(ddp_actor, seed=1)
    rank_grads = ddp_actor.group.call("gradients")
    single_grads = {n: p.grad for n, p in single.model.named_parameters()}
    for name in rank_grads[0]:  # DDP leaves identical gradients on every rank
        assert torch.equal(rank_grads[0][name], rank_grads[1][name]), name
    grad_diff = max_abs_diff(rank_grads[0], single_grads)
    weights = {n: p.detach() for n, p in single.model.named_parameters()}
    weight_diff = max_abs_diff(ddp_actor.state_dict_for_rollout(), weights)
    print(f"\nDDP vs single: max |grad diff| {grad_diff:.2e}, max |weight diff| {weight_diff:.2e}")
    assert grad_diff < TOLERANCE and weight_diff < TOLERANCE
    assert ddp_actor.updates == single.updates
    assert weight_diff < max_abs_diff(weights, dict(tiny_model().named_parameters()))
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/trained_fraction"):
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name


def test_a_rank_with_no_rows_and_an_empty_mini_batch_still_match(ddp_actor):
    """One live row in the whole batch: one mini-batch leaves rank 1 nothing (it backpropagates
    a zero-weighted row), the other has no live row at all (a zero-gradient step everywhere)."""
    single, expected, got = update_both(ddp_actor, seed=2, live_rows=[3])
    weights = {n: p.detach() for n, p in single.model.named_parameters()}
    assert max_abs_diff(ddp_actor.state_dict_for_rollout(), weights) < TOLERANCE
    assert got["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], rel=1e-5, abs=1e-7)


# --- the controller loop with the DDP actor -----------------------------------------------------
class RandomRollout(Generator):
    """Random response tokens, reported as produced by the version the trainer asks for."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return self._one(request)

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return [self._one(r) for r in requests]

    def _one(self, request: GenerateRequest) -> GenerateResult:
        n, length = request.sampling.n, request.sampling.max_tokens
        rows = [[self.rng.randrange(1, VOCAB) for _ in range(length)] for _ in range(n)]
        completions = [Completion(row, [], "", "length") for row in rows]
        return GenerateResult(request.request_id, completions, request.min_weight_version, "f")

    async def close(self) -> None:
        pass


class VariedReward(ScoreService):
    """Scores spread over [0, 1) so that groups rarely tie (every step trains some rows)."""

    async def score_batch(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        scores = [sum(map(ord, r.solution_str)) % 7 / 7 for r in requests]
        return [ScoreResult(r.id, score, {}, "") for r, score in zip(requests, scores, strict=True)]

    async def close(self) -> None:
        pass


class RecordingSync(WeightPublisher):
    def __init__(self) -> None:
        self.pushed: list[tuple[int, dict]] = []

    async def push(
        self, state_dict: dict, version: int, flush_cache: bool = True, only_stale: bool = False
    ) -> dict[str, float]:
        if not only_stale:
            self.pushed.append((version, {k: v.clone() for k, v in state_dict.items()}))
        return {"timing_s/update_weights": 0.0}

    async def wait_for_replicas(self, count: int, timeout_s: float) -> list[ReplicaStatus]:
        return []

    async def close(self) -> None:
        pass


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)

    def save_pretrained(self, path):
        (path / "tokenizer.marker").write_text("char")


def test_the_controller_loop_trains_and_pushes_rank_0_weights(ddp_actor, tmp_path):
    from rlfleet.trainer.run import TrainingClock, save_checkpoint, train_loop

    config = config_for("ddp", **{"trainer.total_steps": 3, "run_dir": str(tmp_path)})
    sync = RecordingSync()
    fleet = Fleet(RandomRollout(), VariedReward(), None, sync)
    trainer = Trainer(config, fleet, ddp_actor, CharTokenizer())
    fetches = []
    fetch = ddp_actor.group.call_rank0
    ddp_actor.group.call_rank0 = lambda method, *a: fetches.append(method) or fetch(method, *a)
    records = [PromptRecord("p", "count", "", {}, [1, 2, 3 + i]) for i in range(6)]
    rows = []

    class Writer(StepWriter):
        def write(self, step: int, metrics: Mapping[str, float]) -> None:
            rows.append(dict(metrics))

        def log_samples(self, step: int, samples: list[Mapping]) -> None:
            pass

    async def go():
        await trainer.start(1, 1.0)  # fetches rank 0's weights unless the last update's are held
        fetches.clear()
        await train_loop(trainer, records, Writer(), (), TrainingClock(1.0))

    try:
        asyncio.run(go())
    finally:
        ddp_actor.group.call_rank0 = fetch
    assert [version for version, _ in sync.pushed] == [1, 2, 3, 4]
    assert fetches.count("parameters") == 3  # one per update; none for the stale checks
    assert all("actor/pg_loss" in row and "actor/grad_norm" in row for row in rows)
    rank0 = ddp_actor.state_dict_for_rollout()
    assert max_abs_diff(sync.pushed[-1][1], rank0) == 0.0
    assert max_abs_diff(sync.pushed[0][1], rank0) > 0.0  # the steps changed the weights

    # A checkpoint from rank 0 is the single actor's format: it loads into one.
    from rlfleet.model.model_io import load_causal_lm

    path = save_checkpoint(trainer, tmp_path / "ckpt")
    single = single_copy_of(ddp_actor)
    restored = Actor(config_for("single"), load_causal_lm(path), pad_id=0)
    restored.load_training_state(path)
    assert restored.updates == ddp_actor.updates == single.updates
    assert max_abs_diff(dict(restored.model.named_parameters()), rank0) == 0.0
    first = restored.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(first, single.optimizer.state_dict()["state"][0]["exp_avg"])
    assert ddp_actor.load_training_state(path)["updates"] == ddp_actor.updates  # and back


def test_single_rejects_several_ranks_and_parallel_actor_rejects_single():
    from pydantic import ValidationError

    from rlfleet.trainer.ddp import parallel_actor

    with pytest.raises(ValueError, match="strategy ddp"):
        parallel_actor(config_for("single"), None, 0)
    with pytest.raises(ValidationError, match="world_size"):
        config_for("single", **{"trainer.world_size": 2})
