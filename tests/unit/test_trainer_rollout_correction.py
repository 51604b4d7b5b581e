"""The trainer with ``algorithm.rollout_correction``: where the correction runs (once per batch
in decoupled mode, in the loss in bypass mode), and the ``rollout_corr/*`` mismatch metrics
every step, with the fakes of ``trainer_fakes`` and an engine that reports log-probs."""

from __future__ import annotations

import asyncio

import pytest
import torch
from trainer_fakes import SamplingRollout, make_trainer, prompts

from rlfleet.common.config import load_config
from rlfleet.rollout.types import Completion, GenerateResult
from rlfleet.trainer.correction import correct_batch
from rlfleet.trainer.rollout_batch import RolloutBatch


class ReportingRollout(SamplingRollout):
    """Samples like ``SamplingRollout`` and reports each token's log-prob as an engine of
    another precision would: the model's own, off by a little noise."""

    async def generate(self, request):
        result = await super().generate(request)
        prompt = request.prompt_token_ids
        completions = []
        for c in result.completions:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = self.model(ids).logits[0, len(prompt) - 1 : -1].float()
            picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])
            noisy = picked[:, 0] + 0.05 * torch.randn(len(c.token_ids))
            completions.append(Completion(c.token_ids, noisy.tolist(), c.text, c.finish_reason))
        return GenerateResult(
            result.request_id, completions, result.weight_version, result.replica_id
        )


def reporting_trainer(**overrides):
    trainer = make_trainer(**overrides)
    trainer.fleet.rollout = ReportingRollout(trainer.actor.model)
    return trainer


def config(**overrides):
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()], env={})


def batch() -> RolloutBatch:
    return RolloutBatch(
        responses=[[5, 6], [7]],
        engine_logprobs=[[-1.0, -1.0], [-0.5]],
        old_logprobs=[[-1.0, -1.0 + 2.0], [-0.5]],
    )


def test_decoupled_correction_weights_and_rejects_once_per_batch():
    cfg = config(
        **{
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": "'0.5_2'",
        }
    )
    rows = batch()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kept, metrics = correct_batch(rows, mask, cfg, actor_old=True)
    # token (0, 1): pi_old / pi_rollout = e^2, truncated at 2 and rejected (ratio < 0.5)
    assert rows.rollout_is_weights == [[1.0, 2.0], [1.0]]
    assert kept.tolist() == [[1.0, 0.0], [1.0, 0.0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/kl"] == pytest.approx(-2 / 3)
    assert not rows.rollout_logprobs


def test_without_correction_the_metrics_are_measured_where_the_log_probs_meet():
    rows, mask = batch(), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kept, metrics = correct_batch(rows, mask, config(), actor_old=True)
    assert kept is mask and metrics["rollout_corr/chi2_token"] > 0 and not rows.rollout_is_weights
    rows = batch()  # no actor forward this step: the update's forward measures it
    assert correct_batch(rows, mask, config(), actor_old=False) == (mask, {})
    assert rows.rollout_logprobs is rows.engine_logprobs


@pytest.mark.parametrize(
    "preset",
    [None, "decoupled_token_is", "decoupled_seq_is_rs", "bypass_ppo_clip_k3_rs", "bypass_pg_is"],
)
def test_a_step_with_each_kind_of_correction_reports_verl_metrics(preset):
    overrides = {"algorithm.rollout_correction.preset": preset} if preset else {}
    trainer = reporting_trainer(**overrides)
    asyncio.run(trainer.start(1, 1.0))
    metrics = asyncio.run(trainer.train_step(prompts()))
    for name in (
        "kl",
        "k3_kl",
        "training_ppl",
        "rollout_ppl",
        "log_ppl_diff",
        "ppl_ratio",
        "chi2_token",
        "chi2_seq",
    ):
        assert f"rollout_corr/{name}" in metrics, name
    assert metrics["rollout_corr/kl"] == pytest.approx(metrics["rollout_corr/kl"])  # not nan
    if preset and "is" in preset.split("_"):
        assert "rollout_corr/rollout_is_mean" in metrics
    if preset and preset.endswith("rs"):
        assert "rollout_corr/rollout_rs_masked_fraction" in metrics


def test_bypass_mode_uses_the_engine_log_probs_as_the_old_policy_without_a_forward():
    trainer = reporting_trainer(**{"algorithm.rollout_correction.preset": "bypass_ppo_clip"})
    asyncio.run(trainer.start(1, 1.0))
    rows = asyncio.run(trainer.collector.generate(prompts(2), 0, 1))
    calls = []
    trainer.actor.logprobs = lambda p, r: calls.append(1)
    asyncio.run(trainer.old_logprobs(rows))
    assert not calls and rows.old_logprobs is rows.engine_logprobs


@pytest.mark.parametrize("preset", [None, "decoupled_token_is", "bypass_pg_geo_rs"])
def test_async_steps_with_stale_rows_report_the_mismatch(preset):
    from test_async_training import LaggingRollout, run

    overrides = {
        "trainer.mode": "async",
        "trainer.max_staleness": 1,
        "trainer.total_steps": 3,
        "data.train_batch_size": 4,
    }
    if preset:
        overrides["algorithm.rollout_correction.preset"] = preset
    trainer = reporting_trainer(**overrides)
    trainer.fleet.rollout = LaggingRollout(trainer.fleet.rollout, trainer.fleet.weight_sync)
    rows = run(trainer, 3)
    assert max(row["async/staleness/max"] for row in rows) == 1  # stale rows were trained
    for row in rows:
        assert "rollout_corr/k3_kl" in row and "rollout_corr/chi2_seq" in row
        # the suite replaces trainer.is_cap's weights when it is on
        assert ("async/importance_weight/mean" in row) == (
            preset is None and row["async/staleness/max"] > 0
        )


def test_k3_rejection_drops_whole_responses_and_the_update_trains_the_rest_alone():
    """Hand-computed ``decoupled_k3_rs`` (seq mean of k3 = r - 1 - log r <= 0.01): row 1's
    log r = 0.5 on both tokens gives k3 = e^0.5 - 1.5 = 0.1487, rejected whole; row 2's mean
    is (e^0.1 - 1.1) / 2 = 0.0026, kept. The update with the rejected row masked then moves
    the weights, with the same gradient, as one on the other rows alone: the mask takes the
    row out of the loss and its normaliser and changes nothing else (advantages, the other
    rows, their weight)."""
    import copy

    from trainer_fakes import tiny_model

    from rlfleet.trainer.actor import Actor

    cfg = config(
        **{
            "algorithm.rollout_correction.preset": "decoupled_k3_rs",
            "trainer.lr": 1e-2,
            "trainer.ppo_mini_batch_size": 0,
            "trainer.grad_clip": 1e9,  # the gradients compared as they are, not clipped
            "trainer.use_kl_loss": False,  # as the default job: zero-advantage rows skipped
        }
    )
    prompts = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    responses = [[5, 6], [8, 9], [5, 7]]
    model = tiny_model()
    old = Actor(cfg, copy.deepcopy(model), 0).logprobs(prompts, responses)
    shift = [[0.0, 0.0], [0.5, 0.5], [0.1, 0.0]]
    engine = [
        [o - s for o, s in zip(row, d, strict=True)] for row, d in zip(old, shift, strict=True)
    ]
    rows = RolloutBatch(
        prompts=prompts, responses=responses, engine_logprobs=engine, old_logprobs=old
    )
    mask = torch.ones(3, 2)
    kept, metrics = correct_batch(rows, mask, cfg, actor_old=True)
    assert kept.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert not rows.rollout_is_weights
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-0.5, -0.5]])
    masked = Actor(cfg, copy.deepcopy(model), 0)
    masked.update(rows, advantages, kept, orders=[[0, 1, 2]])
    alone = Actor(cfg, copy.deepcopy(model), 0)
    two = rows.select([0, 2])
    alone.update(two, advantages[[0, 2]], mask[[0, 2]], orders=[[0, 1]])
    untouched = Actor(cfg, copy.deepcopy(model), 0)
    for a, b in zip(masked.model.parameters(), alone.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # Adam's step: blind to scale
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)  # not the gradient
    assert any(
        not torch.equal(a, c)
        for a, c in zip(masked.model.parameters(), untouched.model.parameters(), strict=True)
    )
