"""The ``agent`` config section: defaults, names checked for their form, cross-field rules."""

from __future__ import annotations

import pytest

from rlfleet.common.config import load_config
from rlfleet.common.config.agent import AgentConfig

AGENT = ["agent.env=calc", "agent.max_episode_tokens=64"]  # fits rollout.max_model_len 64


def test_defaults_mean_no_agent_mode():
    agent = load_config(None, [], env={}).agent
    assert agent == AgentConfig()
    assert (agent.env, agent.max_turns, agent.max_episode_tokens) == ("", 8, 512)
    assert agent.address == f"127.0.0.1:{agent.port}"


@pytest.mark.parametrize("env", ["calc", "my_envs.math:MathEnv", "pkg.mod:make.env"])
def test_builtin_names_and_import_paths_load(env):
    config = load_config(None, [f"agent.env={env}", "agent.max_episode_tokens=64"], env={})
    assert config.agent.env == env


@pytest.mark.parametrize("env", ["my env", "module:", ":attr", "a/b.py:Env", "a:b:c"])
def test_a_malformed_env_name_is_refused(env):
    with pytest.raises(ValueError, match="agent.env"):
        AgentConfig(env=env)


def test_tools_are_import_paths_for_an_imported_environment():
    ok = AgentConfig(env="envs:ToolUser", tools=["tools:add", "tools.math:mul"])
    assert ok.tools == ["tools:add", "tools.math:mul"]
    with pytest.raises(ValueError, match="import paths"):
        AgentConfig(env="envs:ToolUser", tools=["add"])
    with pytest.raises(ValueError, match="needs agent.env"):
        AgentConfig(tools=["tools:add"])
    with pytest.raises(ValueError, match="brings its own tools"):
        AgentConfig(env="calc", tools=["tools:add"])


def test_timeouts_must_nest():
    with pytest.raises(ValueError, match="must nest"):
        AgentConfig(tool_timeout_s=30, step_timeout_s=10)
    with pytest.raises(ValueError, match="must nest"):
        AgentConfig(step_timeout_s=700)
    with pytest.raises(ValueError, match="request_timeout_s"):
        AgentConfig(request_timeout_s=60)


def test_limits_and_counts_are_bounded():
    for bad in (
        {"max_turns": 0},
        {"max_episode_tokens": 1},
        {"workers": -1},
        {"concurrency": 0},
        {"port": 70000},
    ):
        with pytest.raises(ValueError):
            AgentConfig(**bad)


def test_episode_budget_must_fit_the_replicas_only_in_agent_mode():
    load_config(None, ["agent.max_episode_tokens=4096"], env={})  # no agent.env: not checked
    with pytest.raises(ValueError, match="rollout.max_model_len"):
        load_config(None, ["agent.env=calc"], env={})  # 512 > 64
    assert load_config(None, AGENT, env={}).agent.env == "calc"
    bigger = load_config(None, [*AGENT[:1], "rollout.max_model_len=1024"], env={})
    assert bigger.agent.max_episode_tokens == 512
