import logging
from pathlib import Path

import pytest
import yaml

from rlfleet.common import entry
from rlfleet.common.config import RlfleetConfig, describe_fields, load_config
from rlfleet.model.hub import is_repo_id
from rlfleet.model.model_io import load_tokenizer

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


GPU_HOST_EXAMPLES = {"grpo_gsm8k.yaml"}
"""Configs for a GPU host with its own model (a Hub id) and data: they load here, but their
files are not part of the checkout."""


BUILT_MODEL_CONFIGS = {
    "grpo_countdown_smollm2.yaml",
    "grpo_countdown_smollm2_lora.yaml",
    "grpo_smollm2_math.yaml",
    "sft_smollm2_math.yaml",
}
"""Configs whose model (`make smollm2`) and data (`make data-real`) are built into the rlfleet
cache, outside the checkout: their model.path is a short name of rlfleet.model.local_models."""


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    from rlfleet.model.local_models import is_local_name

    config = load_config(path, env={})
    if path.name in BUILT_MODEL_CONFIGS:
        assert is_local_name(config.model.path)
        assert all(f.endswith(".parquet") for f in config.data.train_files + config.data.val_files)
        return
    if path.name in GPU_HOST_EXAMPLES:
        assert not Path(config.model.path).exists() and is_repo_id(config.model.path)
        return
    assert Path(config.model.path).is_dir()
    assert all(Path(f).is_file() for f in config.data.train_files + config.data.val_files)


def test_every_field_is_documented():
    undocumented = [line for line in describe_fields() if line.rstrip().endswith(":")]
    assert not undocumented, undocumented


def test_help_config_spells_out_optional_sections():
    lines = describe_fields()
    for name in ("reward.custom.path", "reward.custom.name", "reward.custom.reward_kwargs"):
        assert any(line.startswith(f"{name} ") for line in lines), name
    assert "reward.custom.path (required): Python file defining the function." in lines


@pytest.mark.parametrize(("given", "level"), [("debug", "DEBUG"), ("Warning", "WARNING")])
def test_log_level_is_case_insensitive(given, level):
    assert load_config(None, [f"log_level={given}"], env={}).log_level == level


def test_misspelt_log_level_is_an_error():
    with pytest.raises(ValueError, match="log_level"):
        load_config(None, ["log_level=verbose"], env={})


def test_shipped_defaults_are_found_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, env={})
    assert Path(config.model.path) == ROOT / "models" / "tiny-qwen2-arith"
    assert config.data.train_files == [str(ROOT / "data" / "arith" / "train.jsonl")]
    assert RlfleetConfig.model_fields["model"].default.path == "models/tiny-qwen2-arith"


def test_relative_path_that_exists_here_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny-qwen2-arith").mkdir(parents=True)
    assert load_config(None, env={}).model.path == "models/tiny-qwen2-arith"


def test_missing_model_path_is_named_not_looked_up_online(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub-like name: cache only, never the network
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config = load_config(None, ["model.path=no/such-model"], env={})
    assert config.model.path == "no/such-model"
    with pytest.raises(FileNotFoundError, match="model path not found: no/such-model"):
        load_tokenizer(config.model.path)


def test_start_up_logs_one_line_and_writes_the_resolved_config(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(entry, "setup_logging", lambda level, role: None)  # keep caplog's handler
    caplog.set_level(logging.INFO, logger=entry.__name__)
    overrides = [f"run_dir={tmp_path}", "api_key=s3cret", "redis_url=redis://:pw@h:1/0"]
    config, _ = entry.resolve(entry.base_parser("reward", "test"), "reward", overrides)
    [line] = [r.getMessage() for r in caplog.records if r.name == entry.__name__]
    assert "\n" not in line and line.startswith("reward config: cluster=default")
    written = tmp_path / "config.reward.yaml"
    assert str(written) in line
    text = written.read_text()
    assert "s3cret" not in text and ":pw@" not in text
    assert RlfleetConfig.model_validate(yaml.safe_load(text)).trainer == config.trainer


def test_client_verbs_write_no_config(tmp_path, monkeypatch):
    monkeypatch.setattr(entry, "setup_logging", lambda level, role: None)
    entry.resolve(entry.base_parser("status", "test"), "status", [f"run_dir={tmp_path}"])
    assert list(tmp_path.iterdir()) == []
