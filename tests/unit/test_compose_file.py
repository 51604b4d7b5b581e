"""docker-compose.yml against the configs it runs (nothing here starts Docker): the env role
of agent mode is a service scaled like rollout (no fixed name, no host port), off for the
default job, and its port, address and gateway agree with configs/compose_agent.yaml."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlfleet.common.config import load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def health_port(service: str) -> int:
    return int(SERVICES[service]["healthcheck"]["test"][-1].rsplit(":", 1)[1])


def test_env_service_scales_like_rollout_and_is_off_by_default():
    env = SERVICES["env"]
    assert env["command"].split()[:2] == ["rlfleet", "env"]
    assert "container_name" not in env and "ports" not in env  # so --scale env=N works
    assert env["scale"] == 0  # the default job has no agent.env
    assert env["depends_on"] == {"redis": {"condition": "service_healthy"}}


def test_compose_agent_config_matches_the_env_service():
    agent = load_config(str(ROOT / "configs" / "compose_agent.yaml"), [])
    default = load_config(str(ROOT / "configs" / "compose.yaml"), [])
    assert agent.agent.env and agent.agent.port == health_port("env")
    assert (
        agent.agent.address
        == f"env:{agent.agent.port}"
        == SERVICES["env"]["environment"]["RLFLEET_ENV_ADDR"]
    )
    assert agent.agent.gateway_url == f"http://router:{agent.router.http_port}/v1"
    assert agent.endpoints == default.endpoints
    for role in ("router", "reward", "refcritic"):
        assert getattr(agent, role).port == getattr(default, role).port == health_port(role)
