"""Secrets never on a role's command line (issue 19): ``rlfleet up`` moves the API key and the
Redis URL (which may hold a password) from the overrides into each role's environment, under
the ``RLFLEET_*`` names the config reads, and the role still ends up with the same settings.
tests/integration/test_secrets_argv.py checks the real processes' ``/proc/<pid>/cmdline``."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

from rlfleet.common.config import load_config
from rlfleet.launch.local import plan_children
from rlfleet.launch.process import role_argv, role_env, split_secrets
from rlfleet.launch.ray_up import launch_settings

AGENT_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "agent_calc.yaml")
KEY = "sk-test-4f1c9a"
PASSWORD = "hunter2pw"
REDIS = f"redis://:{PASSWORD}@127.0.0.1:7/0"


def test_secret_overrides_move_to_the_environment_and_the_rest_stay():
    plain, secrets = split_secrets(
        [f"api_key={KEY}", f"redis_url={REDIS}", "trainer.total_steps=3", "cluster=x"]
    )
    assert plain == ["trainer.total_steps=3", "cluster=x"]
    assert secrets == {"RLFLEET_API_KEY": KEY, "RLFLEET_REDIS_URL": REDIS}


def test_a_secret_switched_off_stays_an_override_and_typed_text_is_kept():
    plain, secrets = split_secrets(["api_key=null", "api_key="])
    assert plain == ["api_key=null", "api_key="] and secrets == {}
    assert split_secrets(['api_key="a b"'])[1] == {"RLFLEET_API_KEY": "a b"}  # YAML unquoted
    assert split_secrets(["api_key=12345"])[1] == {"RLFLEET_API_KEY": "12345"}  # not int 12345


def test_role_env_carries_secrets_and_the_launchers_redis():
    env = role_env("redis://127.0.0.1:9/0", {"RLFLEET_API_KEY": KEY})
    assert env["RLFLEET_API_KEY"] == KEY and env["RLFLEET_REDIS_URL"] == "redis://127.0.0.1:9/0"


def test_role_env_gives_lean_malloc_and_passive_threads_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = role_env("redis://127.0.0.1:9/0")
    assert env["MALLOC_MMAP_THRESHOLD_"] == "1048576" and env["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert role_env("redis://127.0.0.1:9/0")["MALLOC_MMAP_THRESHOLD_"] == "65536"


def up_args(tmp_path: Path, **extra) -> tuple[Namespace, list[str]]:
    overrides = [
        f"run_dir={tmp_path}",
        f"api_key={KEY}",
        f"redis_url={REDIS}",
        "dashboard.enabled=false",
    ]
    defaults = dict(config=AGENT_CONFIG, rollout_replicas=2, no_trainer=False, env_processes=2)
    return Namespace(overrides=overrides, **{**defaults, **extra}), overrides


def role_config(argv: list[str], env: dict[str, str]):
    """The config a role builds from its command line and environment, as ``resolve`` does."""
    overrides = [item for item in argv[4:] if "=" in item and not item.startswith("-")]
    config_path = argv[argv.index("--config") + 1] if "--config" in argv else None
    return load_config(config_path, overrides, env=env)


def test_no_local_role_gets_a_secret_on_its_command_line_yet_each_has_them(tmp_path):
    args, overrides = up_args(tmp_path)
    config = load_config(AGENT_CONFIG, overrides, env={})
    children = plan_children(config, args, REDIS, tmp_path)
    names = [c.name for c in children]
    assert {"router", "rollout-0", "rollout-1", "reward", "env", "env-1", "trainer"} <= set(names)
    for child in children:
        line = " ".join(child.argv)
        assert KEY not in line and PASSWORD not in line, (child.name, line)
        seen = role_config(child.argv, child.env)
        assert seen.api_key == KEY and seen.redis_url == REDIS, child.name


def test_extra_env_processes_are_worker_only_with_the_flag_before_overrides(tmp_path):
    args, overrides = up_args(tmp_path, env_processes=3)
    children = plan_children(load_config(AGENT_CONFIG, overrides, env={}), args, REDIS, tmp_path)
    workers = [c for c in children if c.name.startswith("env-")]
    assert [c.name for c in workers] == ["env-1", "env-2"]
    for child in workers:
        verb = child.argv.index("rlfleet.cli") + 1  # after a `setpriv --pdeathsig` prefix
        assert child.argv[verb : verb + 4] == ["env", "--config", AGENT_CONFIG, "--worker-only"]
    front = next(c for c in children if c.name == "env")
    assert "--worker-only" not in front.argv


def test_ray_launch_keeps_secrets_out_of_the_shared_overrides(tmp_path):
    args, overrides = up_args(tmp_path)
    config = load_config(AGENT_CONFIG, overrides, env={})
    launch = launch_settings(config, args, REDIS, "127.0.0.1")
    assert not any(KEY in item or PASSWORD in item for item in launch.common)
    assert launch.secrets == {"RLFLEET_API_KEY": KEY, "RLFLEET_REDIS_URL": REDIS}
    argv = role_argv("reward", launch.config_path, list(launch.common))  # as RoleActor builds it
    seen = role_config(argv, role_env(launch.redis_url, launch.secrets))
    assert seen.api_key == KEY and seen.redis_url == REDIS
