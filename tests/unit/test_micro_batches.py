"""Gradient accumulation over micro-batches (``trainer.ppo_micro_batch_size``).

A mini-batch trained in micro-batches, each loss weighted by its share of the aggregation's
denominator, must leave the same gradient as one forward over every row, for every
``loss_agg_mode`` and with the zero-advantage skip dropping rows first; its metrics must be the
whole mini-batch's. The data-parallel ranks use the same helper on their shards, with every
rank running as many micro-batches as the largest shard needs.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import random_qwen2

from rlfleet.common.config import load_config
from rlfleet.rl import core_algos
from rlfleet.rl.losses import LossInputs, LossParams, actor_loss, token_entropy
from rlfleet.trainer.actor import Actor, MetricSums, map_row_groups, split_bounds
from rlfleet.trainer.rollout_batch import RolloutBatch, response_mask

VOCAB = 16
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"]
ZERO_GROUP = 2
"""The prompt group whose rows all have zero advantage (dropped by the skip)."""


def config_for(mode: str, micro: int, **extra):
    items = {
        "trainer.use_kl_loss": "false",
        "trainer.loss_agg_mode": mode,
        "trainer.ppo_micro_batch_size": micro,
        "trainer.grad_clip": 1e9,  # the gradients after the update are the raw ones
        "rollout.n": 4,
        "rollout.max_tokens": 6,
        "data.train_batch_size": 3,
        **extra,
    }
    return load_config(None, [f"{k}={v}" for k, v in items.items()], env={})


def tiny_model():
    return random_qwen2(hidden=32, layers=1, heads=2, kv_heads=1, vocab=VOCAB)


def make_batch(seed: int = 0):
    """11 rows of 3 prompts (groups of 4, 4 and 3), uneven response lengths; old and behaviour
    log-probs off the current ones (ratios are clipped, importance weights vary); the third
    group's advantages are zero (the zero-advantage skip drops it)."""
    rng = random.Random(seed)
    prompts, responses, groups = [], [], []
    for group, size in enumerate((4, 4, 3)):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))]
        for _ in range(size):
            prompts.append(prompt)
            responses.append([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))])
            groups.append(group)
    batch = RolloutBatch(prompts=prompts, responses=responses)
    lengths = batch.response_lengths()
    batch.old_logprobs = [[rng.uniform(-3.5, -2.0) for _ in range(n)] for n in lengths]
    batch.behaviour_logprobs = [[rng.uniform(-3.5, -2.0) for _ in range(n)] for n in lengths]
    mask = response_mask(lengths)
    values = [0.0 if g == ZERO_GROUP else rng.uniform(-1, 1) for g in groups]
    return batch, torch.tensor(values)[:, None] * mask, mask


def actor_for(mode: str, micro: int, **extra) -> Actor:
    return Actor(config_for(mode, micro, **extra), tiny_model(), pad_id=0)


def recorded_forwards(actor: Actor) -> list[list[int]]:
    """The rows (batch indices) of each ``mini_batch_loss`` call ``actor`` makes from now on."""
    calls: list[list[int]] = []
    forward = actor.mini_batch_loss

    def recording(batch, idx, *args):
        calls.append(list(idx))
        return forward(batch, idx, *args)

    actor.mini_batch_loss = recording
    return calls


def whole_batch_gradients(mode: str, batch, advantages, mask) -> dict[str, torch.Tensor]:
    """One forward and backward over every row, no skip, no micro-batches: the reference."""
    actor = actor_for(mode, 0)
    rows = actor._padded_extras(batch, mask.shape[1])
    loss, _ = actor.mini_batch_loss(batch, list(range(len(batch))), advantages, mask, rows)
    loss.backward()
    return {name: p.grad.clone() for name, p in actor.model.named_parameters()}


def updated(mode: str, micro: int, batch, advantages, mask):
    actor = actor_for(mode, micro)
    calls = recorded_forwards(actor)
    metrics = actor.update(batch, advantages, mask, orders=[list(range(len(batch)))])
    grads = {name: p.grad.clone() for name, p in actor.model.named_parameters()}
    return metrics, grads, calls


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_leave_the_whole_batch_gradient_and_metrics(mode):
    batch, advantages, mask = make_batch()
    expected = whole_batch_gradients(mode, batch, advantages, mask)
    kept = list(range(8))  # the third group (rows 8-10) has zero advantage
    today, today_grads, today_calls = updated(mode, 0, batch, advantages, mask)
    assert today_calls == [kept]  # micro 0: one forward over the kept rows (the skip is on)
    assert today["actor/pg_clipfrac"] > 0.0  # the ratios are clipped somewhere
    for name in expected:
        torch.testing.assert_close(today_grads[name], expected[name], rtol=0, atol=1e-6)
    for micro in (1, 2, 3):
        metrics, grads, calls = updated(mode, micro, batch, advantages, mask)
        sizes = [len(rows) for rows in calls]
        assert len(calls) == -(-len(kept) // micro) and max(sizes) == micro, (micro, sizes)
        assert sorted(i for rows in calls for i in rows) == kept
        for name in expected:
            torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=1e-6)
        assert metrics.keys() == today.keys()
        for key, value in today.items():
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (micro, key)


def test_a_micro_batch_holds_the_rows_of_one_prompt_when_they_fit():
    batch, advantages, mask = make_batch()
    actor = actor_for("token-mean", 4)
    calls = recorded_forwards(actor)
    order = list(range(len(batch)))
    random.Random(3).shuffle(order)
    actor.update(batch, advantages, mask, orders=[order])
    assert [len({tuple(batch.prompts[i]) for i in rows}) for rows in calls] == [1, 1]


def test_the_log_prob_forward_goes_in_micro_batches_with_the_same_values():
    batch, _, _ = make_batch()
    whole = actor_for("token-mean", 0)
    expected = whole.logprobs(batch.prompts, batch.responses)
    chunked = actor_for("token-mean", 3)
    sizes = []
    forward = chunked._logprobs_of
    chunked._logprobs_of = lambda p, r, **kw: sizes.append(len(p)) or forward(p, r, **kw)
    got = chunked.logprobs(batch.prompts, batch.responses)
    assert sizes == [3, 3, 3, 2]
    assert [len(row) for row in got] == batch.response_lengths()
    for a, b in zip(got, expected, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_map_row_groups_puts_results_back_in_input_order():
    prompts = [[3], [1], [3], [2], [1]]
    responses = [[1] * n for n in (2, 1, 1, 3, 2)]
    seen = []

    def tag(ps, rs):
        seen.append([(p[0], len(r)) for p, r in zip(ps, rs, strict=True)])
        return [(p[0], len(r)) for p, r in zip(ps, rs, strict=True)]

    out = map_row_groups(prompts, responses, 2, tag)
    assert out == [(3, 2), (1, 1), (3, 1), (2, 3), (1, 2)]
    assert seen == [[(1, 1), (1, 2)], [(2, 3), (3, 1)], [(3, 2)]]  # same prompt together
    seen.clear()
    assert map_row_groups(prompts, responses, 0, tag) == out and len(seen) == 1


def test_split_bounds_cover_the_rows_once():
    for rows in range(0, 12):
        for parts in range(1, 5):
            bounds = [split_bounds(rows, part, parts) for part in range(parts)]
            assert bounds[0][0] == 0 and bounds[-1][1] == rows
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
            assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


def test_metric_sums_weigh_token_means_by_tokens_and_losses_by_the_denominator():
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    sums = MetricSums("seq-mean-token-mean", mask)
    assert sums.add({"actor/pg_loss": 2.0, "actor/pg_clipfrac": 0.5, "x/max": 1.0}, mask[:1]) == 0.5
    sums.add({"actor/pg_loss": 4.0, "actor/pg_clipfrac": 1.0, "x/max": 3.0}, mask[1:])
    sums.add({"actor/pg_loss": 9.0, "actor/pg_clipfrac": 9.0, "x/max": 9.0}, mask[:0])  # empty
    assert sums.metrics == pytest.approx(
        {"actor/pg_loss": 3.0, "actor/pg_clipfrac": 0.625, "x/max": 3.0}
    )


# --- the entropy metric --------------------------------------------------------------------------
def loss_inputs(entropy_coeff: float):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=generator, requires_grad=True)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    labels = torch.randint(0, 7, (3, 4), generator=generator)
    logprob = core_algos.logprobs_from_logits(logits, labels)
    advantages = torch.randn(3, 1, generator=generator) * mask
    inputs = LossInputs(logits, logprob, logprob.detach() + 0.1, advantages, mask)
    return LossParams(entropy_coeff=entropy_coeff), inputs


def test_the_entropy_metric_is_the_same_without_grad():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1), requires_grad=True)
    metric = token_entropy(logits, with_grad=False)
    assert not metric.requires_grad
    torch.testing.assert_close(metric, core_algos.entropy_from_logits(logits).detach())
    params, inputs = loss_inputs(0.0)
    loss, metrics = actor_loss(params, inputs)
    expected = core_algos.agg_loss(
        core_algos.entropy_from_logits(inputs.logits), inputs.response_mask, "token-mean"
    )
    assert metrics["actor/entropy"] == pytest.approx(float(expected.detach()), rel=1e-6)


def test_an_entropy_bonus_still_carries_its_gradient():
    grads = []
    for coeff in (0.0, 0.5):
        params, inputs = loss_inputs(coeff)
        loss, _ = actor_loss(params, inputs)
        (grad,) = torch.autograd.grad(loss, inputs.logits)
        grads.append(grad)
    params, inputs = loss_inputs(0.5)
    entropy = core_algos.agg_loss(
        core_algos.entropy_from_logits(inputs.logits), inputs.response_mask, "token-mean"
    )
    (bonus,) = torch.autograd.grad(-0.5 * entropy, inputs.logits)
    torch.testing.assert_close(grads[1], grads[0] + bonus)
    assert float(bonus.abs().max()) > 0


# --- config ---------------------------------------------------------------------------------------
def test_micro_batch_size_is_checked_at_load():
    base = ["rollout.n=4", "data.train_batch_size=4"]
    assert load_config(None, [*base, "trainer.ppo_micro_batch_size=4"], env={})
    assert load_config(None, [*base, "trainer.ppo_micro_batch_size=16"], env={})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        load_config(None, [*base, "trainer.ppo_micro_batch_size=-1"], env={})
    with pytest.raises(ValueError, match="ppo_micro_batch_size=17 must be 0"):
        load_config(None, [*base, "trainer.ppo_micro_batch_size=17"], env={})
    mini = [*base, "trainer.ppo_mini_batch_size=8"]
    assert load_config(None, [*mini, "trainer.ppo_micro_batch_size=8"], env={})
    with pytest.raises(ValueError, match="at most the 8 sequences"):
        load_config(None, [*mini, "trainer.ppo_micro_batch_size=9"], env={})


# --- the data-parallel ranks' shards ----------------------------------------------------------------
@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of one: the ranks' collectives run (as identities) in this process."""
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/group", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("mode", "live", "micro"),
    [
        ("token-mean", 7, 2),
        ("seq-mean-token-mean", 7, 3),
        ("seq-mean-token-sum-norm", 3, 1),  # rank 0 has 1 row for 2 micro-batches: one is empty
        ("token-mean", 1, 0),  # rank 1 has no row at all
    ],
)
def test_rank_shards_in_micro_batches_add_up_to_the_mini_batch(
    one_process_group, mode, live, micro
):
    """Two ranks played in turn in one process on one model: each runs as many forwards as the
    other, their gradients add up to world_size times the mini-batch's (DDP/FSDP average
    them) and their metrics to the single actor's."""
    from rlfleet.trainer.ranks import ShardedActor

    batch, advantages, mask = make_batch()
    idx = list(range(live))
    single = actor_for(mode, 0)
    rows = single._padded_extras(batch, mask.shape[1])
    picked = {name: value[idx] for name, value in rows.items()}
    expected_metrics = single._backward(batch, idx, advantages[idx], mask[idx], picked, 1.0)
    expected = {name: p.grad.clone() for name, p in single.model.named_parameters()}
    model = tiny_model()
    actor = ShardedActor(config_for(mode, micro), model, 0, train_module=model, rank=0)
    actor.world_size = 2
    calls = recorded_forwards(actor)
    parts, counts = [], []
    for rank in (0, 1):
        actor.rank = rank
        before = len(calls)
        parts.append(actor._backward(batch, idx, advantages[idx], mask[idx], picked, 1.0))
        counts.append(len(calls) - before)
    widest = -(-live // 2)  # the larger shard
    assert counts[0] == counts[1] == (-(-widest // micro) if micro else 1)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad / 2, expected[name], rtol=0, atol=1e-6)
    for key, value in expected_metrics.items():
        if key.endswith("/max"):
            got = max(part[key] for part in parts)
        else:
            got = sum(part[key] for part in parts)
        assert got == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_bf16_autocast_leaves_nearly_the_fp32_gradient_and_log_probs():
    """``trainer.autocast_dtype=bfloat16``: the forwards run in bf16 (weights stay fp32), the
    loss in fp32; the update's gradient and the log-probs stay close to fp32's (bf16 keeps 8
    bits of mantissa, so not equal), and a parameter's gradient is fp32, like the weight."""
    batch, advantages, mask = make_batch()
    grads = {}
    logprobs = {}
    for dtype in ("none", "bfloat16"):
        torch.manual_seed(0)
        actor = actor_for("token-mean", 0, **{"trainer.autocast_dtype": dtype})
        logprobs[dtype] = actor.logprobs(batch.prompts, batch.responses)
        actor.update(batch, advantages, mask, orders=[list(range(len(batch)))])
        grads[dtype] = torch.cat([p.grad.flatten() for p in actor.model.parameters()])
    full, half = grads["none"], grads["bfloat16"]
    assert half.dtype == torch.float32 and bool(torch.isfinite(half).all())
    assert float((half - full).norm() / full.norm()) < 0.1
    assert float(torch.nn.functional.cosine_similarity(half, full, dim=0)) > 0.99
    for exact, rounded in zip(logprobs["none"], logprobs["bfloat16"], strict=True):
        assert rounded == pytest.approx(exact, abs=0.05)
        assert rounded != exact  # the forward really ran in bf16


def test_gradient_checkpointing_recomputes_layers_and_leaves_the_same_update():
    """``model.enable_gradient_checkpointing``: each decoder layer runs again in the backward
    (its activations were not kept), the update takes the single forward (no shared-prompt
    cache), and gradients and metrics are those of the plain update."""
    batch, advantages, mask = make_batch()
    plain, plain_grads, _ = updated("token-mean", 3, batch, advantages, mask)
    actor = actor_for("token-mean", 3, **{"model.enable_gradient_checkpointing": "true"})
    assert actor.model.is_gradient_checkpointing and not actor.share_prompts_in_update
    layer, layer_calls = actor.model.model.layers[0], []
    plain_forward = layer.forward

    def counted_forward(*args, **kwargs):  # a hook would not see the backward's recompute
        layer_calls.append(torch.is_grad_enabled())
        return plain_forward(*args, **kwargs)

    layer.forward = counted_forward
    calls = recorded_forwards(actor)
    metrics = actor.update(batch, advantages, mask, orders=[list(range(len(batch)))])
    assert len(layer_calls) == 2 * len(calls)  # forward, then again in the backward
    for name, param in actor.model.named_parameters():
        torch.testing.assert_close(param.grad, plain_grads[name], rtol=0, atol=1e-6)
    for key, value in plain.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
