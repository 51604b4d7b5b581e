"""The sharded data-parallel actor (``trainer.strategy: fsdp``, FSDP2) on a real local Ray cluster.

Two gloo ranks, each holding half of every parameter and of the AdamW state, against the
single-process ``Actor`` on the same batch and row order: the gathered gradients and the
updated weights agree to float32 rounding, the weights gathered for the push carry the single
actor's names, shapes and dtypes, log-probs agree (also when one rank gets no rows), and the
optimizer state gathered for a checkpoint is the single actor's and shards back on load.
Batches and the single-process side come from ``test_ddp_actor``.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from test_ddp_actor import TOLERANCE, config_for, make_batch, max_abs_diff, tiny_model

from rlfleet.trainer.actor import Actor

pytestmark = pytest.mark.slow


def fsdp_config():
    return config_for("fsdp", **{"trainer.world_size": 2})


@pytest.fixture(scope="module")
def fsdp_actor():
    """One local Ray cluster and one 2-rank FSDP actor for the module; both stopped at the end."""
    ray = pytest.importorskip("ray")
    from rlfleet.trainer.ddp import parallel_actor

    temp = tempfile.mkdtemp(prefix="rlf-fsdp-", dir="/tmp")
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
        actor = parallel_actor(fsdp_config(), tiny_model(), pad_id=0)
        yield actor
    finally:
        if actor is not None:
            actor.close()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def single_copy_of(fsdp_actor) -> Actor:
    """A single-process actor holding the gathered weights and optimizer state."""
    model = tiny_model()
    model.load_state_dict(fsdp_actor.model.state_dict())
    actor = Actor(config_for("single"), model, pad_id=0)
    actor.apply_training_state(fsdp_actor.from_rank0("training_state"))
    return actor


def update_both(fsdp_actor, single, seed: int, live_rows=None):
    batch, advantages, mask = make_batch(seed, live_rows)
    torch.manual_seed(seed)  # both draw the epochs' row orders from the caller's RNG
    expected = single.update(batch, advantages, mask)
    torch.manual_seed(seed)
    got = fsdp_actor.update(batch, advantages, mask)
    return expected, got


def weights_of(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in actor.model.named_parameters()}


def test_two_sharded_ranks_match_the_single_process_update(fsdp_actor):
    single = single_copy_of(fsdp_actor)
    shards = fsdp_actor.group.call("shard_numel")  # each rank holds half of every tensor
    assert sum(shards) == sum(p.numel() for p in single.model.parameters())
    assert max(shards) - min(shards) <= 16
    expected, got = update_both(fsdp_actor, single, seed=1)
    rank_grads = fsdp_actor.group.call("gradients")
    single_grads = {n: p.grad for n, p in single.model.named_parameters()}
    for name in rank_grads[0]:  # the gathered gradients are the same on every rank
        assert torch.equal(rank_grads[0][name], rank_grads[1][name]), name
    grad_diff = max_abs_diff(rank_grads[0], single_grads)
    pushed = fsdp_actor.state_dict_for_rollout()
    weights = weights_of(single)
    weight_diff = max_abs_diff(pushed, weights)
    print(f"\nFSDP vs single: max |grad diff| {grad_diff:.2e}, max |weight diff| {weight_diff:.2e}")
    assert grad_diff < TOLERANCE and weight_diff < TOLERANCE
    assert weight_diff < max_abs_diff(weights, dict(tiny_model().named_parameters()))
    assert list(pushed) == list(single.state_dict_for_rollout())  # names, in order
    for name, tensor in single.state_dict_for_rollout().items():
        assert (pushed[name].shape, pushed[name].dtype) == (tensor.shape, tensor.dtype), name
    assert fsdp_actor.updates == single.updates
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/trained_fraction"):
        assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-7), name


def test_a_rank_with_no_rows_still_matches(fsdp_actor):
    """One live row: one mini-batch leaves rank 1 nothing (a zero-weighted row), the other has
    no live row at all; and log-probs of one row leave rank 1 a dummy forward."""
    single = single_copy_of(fsdp_actor)
    expected, got = update_both(fsdp_actor, single, seed=2, live_rows=[3])
    assert max_abs_diff(fsdp_actor.state_dict_for_rollout(), weights_of(single)) < TOLERANCE
    assert got["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], rel=1e-5, abs=1e-7)
    batch, _, _ = make_batch(3)
    for rows in (slice(0, 1), slice(0, 5)):
        mine = fsdp_actor.logprobs(batch.prompts[rows], batch.responses[rows])
        theirs = single.logprobs(batch.prompts[rows], batch.responses[rows])
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs, strict=True):
            assert a == pytest.approx(b, abs=TOLERANCE)


def test_a_checkpoint_is_the_single_actors_format_and_shards_back(fsdp_actor, tmp_path):
    single = single_copy_of(fsdp_actor)
    update_both(fsdp_actor, single, seed=4)
    fsdp_actor.save_training_state(tmp_path, {"step": 1})
    restored = Actor(config_for("single"), tiny_model(), pad_id=0)
    assert restored.load_training_state(tmp_path)["step"] == 1
    assert restored.updates == single.updates == fsdp_actor.updates
    for index, state in single.optimizer.state_dict()["state"].items():
        saved = restored.optimizer.state_dict()["state"][index]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(saved[key], state[key], atol=TOLERANCE), (index, key)

    # Loaded back into the ranks, the next update still matches the single actor's.
    before = fsdp_actor.from_rank0("training_state")["optimizer"]["state"][0]["exp_avg"]
    assert fsdp_actor.load_training_state(tmp_path)["updates"] == single.updates
    after = fsdp_actor.from_rank0("training_state")["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(before, after)
    update_both(fsdp_actor, single, seed=5)
    assert max_abs_diff(fsdp_actor.state_dict_for_rollout(), weights_of(single)) < TOLERANCE
