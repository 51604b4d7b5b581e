from pathlib import Path

import pytest

from rlfleet.common.config import RlfleetConfig, describe_fields, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_dotted_overrides_and_env_precedence(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_steps: 5\ncluster: fromfile\n")
    env = {"RLFLEET_CLUSTER": "fromenv", "RLFLEET_REDIS_URL": "redis://x:1/0"}
    config = load_config(path, ["trainer.total_steps=7"], env=env)
    assert config.trainer.total_steps == 7
    assert config.cluster == "fromenv"
    assert config.redis_url == "redis://x:1/0"


def test_override_types_are_parsed():
    config = load_config(None, ["rollout.temperature=0.5", "trainer.use_kl_loss=false"], env={})
    assert config.rollout.temperature == 0.5
    assert config.trainer.use_kl_loss is False


def test_unknown_field_and_bad_override_are_errors():
    with pytest.raises(ValueError, match="not_a_field"):
        load_config(None, ["trainer.not_a_field=1"], env={})
    with pytest.raises(ValueError, match="section.field=value"):
        load_config(None, ["trainer.total_steps"], env={})


def test_cross_field_rules_checked_at_load():
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        load_config(None, ["rollout.n=1"], env={})
    with pytest.raises(ValueError, match="must divide"):
        load_config(
            None,
            ["data.train_batch_size=3", "rollout.n=2", "trainer.ppo_mini_batch_size=4"],
            env={},
        )


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path, env={})
    assert isinstance(config, RlfleetConfig)


def test_every_field_is_documented():
    undocumented = [line for line in describe_fields() if line.rstrip().endswith(":")]
    assert not undocumented, undocumented
