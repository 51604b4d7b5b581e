"""The static deployments (docker-compose.yml, deploy/k8s/) are the fleet plan rendered
(``rlfleet.launch.manifests``): the committed files are exactly what it renders, and a change
to the plan or to a shipped config reaches both files. Nothing here starts Docker or a cluster
(tests/unit/test_compose_file.py and test_k8s_manifests.py check the files themselves)."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlfleet.common.config import load_config
from rlfleet.launch.manifests import compose, k8s, rendered, stale
from rlfleet.launch.manifests.roles import static_roles
from rlfleet.launch.plan import plan_fleet

ROOT = Path(__file__).resolve().parents[2]
K8S_CONFIG = ROOT / "deploy" / "k8s" / "config" / "rlfleet.yaml"


def config(path: Path, *overrides: str):
    return load_config(path, list(overrides), env={})


def compose_services(*overrides: str) -> dict[str, dict]:
    roles = static_roles(config(ROOT / compose.CONFIG, *overrides))
    return yaml.safe_load(compose.render(roles))["services"]


def k8s_objects(*overrides: str) -> dict[tuple[str, str], dict]:
    files = k8s.render(static_roles(config(K8S_CONFIG, *overrides)))
    spec = yaml.safe_load(files["kustomization.yaml"])
    assert set(spec["resources"]) - set(files) == set(k8s.HAND_WRITTEN)
    docs = [doc for name, text in files.items() for doc in yaml.safe_load_all(text)]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs if "metadata" in doc}


def test_the_committed_files_are_what_the_plan_renders():
    assert stale(ROOT) == [], "run scripts/render_deploy.py"
    assert {"docker-compose.yml", "deploy/k8s/kustomization.yaml"} <= set(rendered(ROOT))


def test_a_hand_edit_or_a_missing_file_is_found(tmp_path):
    for path in rendered(ROOT):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text((ROOT / path).read_text())
    (tmp_path / "configs").mkdir()
    (tmp_path / compose.CONFIG).write_text((ROOT / compose.CONFIG).read_text())
    (tmp_path / "deploy/k8s/config").mkdir()
    (tmp_path / "deploy/k8s/config/rlfleet.yaml").write_text(K8S_CONFIG.read_text())
    assert stale(tmp_path) == []
    edited = tmp_path / "deploy/k8s/reward.yaml"
    edited.write_text(edited.read_text().replace("replicas: 1", "replicas: 3"))
    (tmp_path / "docker-compose.yml").unlink()
    assert stale(tmp_path) == ["deploy/k8s/reward.yaml", "docker-compose.yml"]


def test_rendering_ignores_the_shell_environment(monkeypatch):
    monkeypatch.setenv("RLFLEET_ROUTER_ADDR", "elsewhere:1")
    monkeypatch.setenv("RLFLEET_CLUSTER", "other")
    assert stale(ROOT) == []


def test_every_role_of_the_plan_is_a_service_in_start_order():
    plan = plan_fleet(config(ROOT / compose.CONFIG), 1, agent=True)
    verbs = list(dict.fromkeys(m.verb for m in plan.members))
    assert list(compose_services()) == ["redis", *verbs]
    pods = [key for key in k8s_objects() if key[0] in ("Deployment", "Job")]
    assert [name for _, name in pods] == verbs


def test_a_role_the_plan_drops_leaves_both_files():
    # No KL term and no critic: no refcritic; the dashboard off: no dashboard.
    off = ("trainer.use_kl_loss=false", "dashboard.enabled=false")
    assert {"refcritic", "dashboard"}.isdisjoint(compose_services(*off))
    services = compose_services(*off)
    assert set(services["trainer"]["depends_on"]) == {"redis", "router", "reward", "rollout"}
    objects = k8s_objects(*off)
    assert not {name for _, name in objects} & {"refcritic", "dashboard"}
    wait = objects[("Job", "trainer")]["spec"]["template"]["spec"]["initContainers"][0]
    assert "refcritic" not in wait["command"][-1] and "reward:50061" in wait["command"][-1]


def test_the_env_role_is_described_off_until_the_config_names_an_environment():
    assert compose_services()["env"]["scale"] == 0
    assert k8s_objects()[("Deployment", "env")]["spec"]["replicas"] == 0
    agent = ("agent.env=calc", "agent.max_episode_tokens=16")
    assert "scale" not in compose_services(*agent)["env"]
    assert k8s_objects(*agent)[("Deployment", "env")]["spec"]["replicas"] == 1


def test_ports_and_replicas_come_from_the_shipped_config():
    services = compose_services("reward.port=50099")
    assert services["reward"]["healthcheck"]["test"][-1] == "127.0.0.1:50099"
    objects = k8s_objects("reward.port=50099", "trainer.min_replicas=3")
    assert objects[("Deployment", "rollout")]["spec"]["replicas"] == 3
    (port,) = objects[("Service", "reward")]["spec"]["ports"]
    assert port["port"] == 50099


def test_each_copy_of_a_scalable_role_has_its_own_stable_id():
    rollout = compose_services()["rollout"]["command"]
    assert "rollout.replica_id=rollout-$$(hostname)" in rollout  # kept across restarts
    assert "rollout.advertise_host=$$(hostname)" in rollout
    (container,) = k8s_objects()[("Deployment", "rollout")]["spec"]["template"]["spec"][
        "containers"
    ]
    assert "rollout.replica_id=$(POD_NAME)" in container["args"]
    assert {e["name"] for e in container["env"]} == {"POD_NAME", "RLFLEET_ADVERTISE_HOST"}
