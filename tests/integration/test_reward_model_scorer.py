"""The ``reward_model`` scorer: a sequence-classification head in the reward workers (issue 21,
part 5).

The reward model is built here from the tiny policy's config (models/tiny-qwen2-arith) with a
fresh, seeded score head, saved next to the tiny tokenizer: no download. Checked: one load per
process however many calls, scores of a batch equal the same items scored one by one (padding
does not leak) and equal again on a second call, a several-label head gives probabilities,
an item longer than the model's context is refused naming that limit while its neighbours are
scored, and through the service a failed item gets ``reward.default_score``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from rlfleet.common.config import RewardConfig, RewardModelConfig
from rlfleet.common.keys import Keys
from rlfleet.common.queue.local_first import WorkerSlots
from rlfleet.reward.reward_model import RewardModel
from rlfleet.reward.scorers import build_registry
from rlfleet.reward.service import RewardService
from rlfleet.reward.types import ScoreRequest

torch = pytest.importorskip("torch")
TINY = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen2-arith"
pytestmark = pytest.mark.skipif(not (TINY / "config.json").exists(), reason="tiny model not built")
ITEMS = ["1+2=3", "12+30=42", "7+7=15", "99+1=100", "5+5=10", "3+4=7", "40+2=42"]


def build_reward_model(directory: Path, num_labels: int = 1) -> Path:
    """A seeded Qwen2 sequence classifier of the tiny policy's shape, saved with its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(TINY, num_labels=num_labels)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm"))


def requests_of(texts: list[str], prompt: str = "") -> list[ScoreRequest]:
    return [ScoreRequest(str(i), "rm", t, prompt=prompt) for i, t in enumerate(texts)]


def test_batched_scores_equal_one_by_one_and_repeat(rm_path: Path) -> None:
    model = RewardModel(RewardModelConfig(path=str(rm_path), batch_size=4))
    batched = model.score_items(requests_of(ITEMS))
    assert all(not r.error for r in batched) and model.forward_passes == 2  # 7 items, 4 a pass
    single = [model.score_items(requests_of([t]))[0].score for t in ITEMS]
    assert [r.score for r in batched] == pytest.approx(single, abs=1e-5)
    again = model.score_items(requests_of(ITEMS))
    assert [r.score for r in again] == [r.score for r in batched]  # deterministic
    assert len({round(r.score, 6) for r in batched}) > 1  # the head reads the text
    loaded = model.loaded()
    assert model.loaded() is loaded  # loaded once


def test_prompt_is_read_and_several_labels_give_a_probability(
    rm_path: Path, tmp_path: Path
) -> None:
    model = RewardModel(RewardModelConfig(path=str(rm_path)))
    bare, prompted = model.score_items(requests_of(["3"]) + requests_of(["3"], prompt="1+2="))
    assert bare.score != prompted.score
    three = build_reward_model(tmp_path / "three", num_labels=3)
    first = RewardModel(RewardModelConfig(path=str(three), label=0)).score_items(requests_of(ITEMS))
    last = RewardModel(RewardModelConfig(path=str(three))).score_items(requests_of(ITEMS))
    assert all(0.0 < r.score < 1.0 for r in first + last)
    assert [r.score for r in first] != [r.score for r in last]


def test_too_long_items_are_refused_with_the_limit(rm_path: Path) -> None:
    model = RewardModel(RewardModelConfig(path=str(rm_path), max_length=1000))
    short, long, other = model.score_items(requests_of(["1+1=2", "1" * 80, "2+2=4"]))
    assert not short.error and not other.error
    assert "more than 64" in long.error and "max_position_embeddings" in long.error
    capped = RewardModel(RewardModelConfig(path=str(rm_path), max_length=8))
    (result,) = capped.score_items(requests_of(["123456789+1"]))
    assert "more than 8 (reward.reward_model.max_length)" in result.error


def test_a_missing_model_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model path not found"):
        build_registry(RewardConfig(reward_model={"path": str(tmp_path / "nowhere")}))


async def test_through_the_service(rm_path: Path, redis_url: str, cluster_name: str) -> None:
    """Selected by claimed data source and by name, batched, failures at default_score."""
    reward = RewardConfig(
        reward_model={"path": str(rm_path), "data_sources": ["rm_source"]}, default_score=-5.0
    )
    registry = build_registry(reward)
    redis = aioredis.Redis.from_url(redis_url)
    try:
        service = RewardService(redis, Keys(cluster_name), reward, registry, WorkerSlots(4))
        await service.start()
        requests = [
            ScoreRequest("a", "rm_source", "1+2=3"),
            ScoreRequest("b", "", "1" * 80, scorer="reward_model"),
            ScoreRequest("c", "", "12+30=42", scorer="reward_model"),
        ]
        a, b, c = await service.score_batch(requests)
    finally:
        await redis.aclose()
    direct = RewardModel(reward.reward_model).score_items(requests_of(["1+2=3", "12+30=42"]))
    assert a.score == pytest.approx(direct[0].score, abs=1e-5) and not a.error
    assert c.score == pytest.approx(direct[1].score, abs=1e-5)
    assert b.score == -5.0 and "more than 64" in b.error
    scorer = registry.named("reward_model")
    assert scorer.reward_model.forward_passes == 1  # the chunk was one call, one pass
