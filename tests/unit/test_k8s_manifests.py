"""The Kubernetes manifests (deploy/k8s/) render, match the Kubernetes schema, and agree with
the config they ship.

Why a test: nothing in CI runs a cluster, so these checks are what keeps the manifests honest.
Rendering uses a small Python reading of kustomization.yaml (``resources`` and
``configMapGenerator``, the only features the file uses) so the test runs anywhere; where a
``kubectl`` binary is on PATH its ``kubectl kustomize`` output must be the same objects. Every
object is validated with kubernetes-validate against the pinned Kubernetes version's schema
(offline, strict: unknown fields fail).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from rlfleet.common.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32"
"""The schema pinned for validation: the oldest minor the manifests must run on (native gRPC
probes are GA since 1.27)."""
GRPC_ROLES = {
    "router": 50051,
    "reward": 50061,
    "refcritic": 50071,
    "trainer": 50081,
    "rollout": 50091,
    "env": 50093,
}
SECTION = {"env": "agent"}
"""The config section of a role where it is not the role's name."""


def render(directory: Path) -> list[dict]:
    """What ``kubectl kustomize directory`` prints, for the features our kustomization uses."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(spec) <= {"apiVersion", "kind", "resources", "configMapGenerator"}, spec.keys()
    objects = [
        doc
        for name in spec["resources"]
        for doc in yaml.safe_load_all((directory / name).read_text())
        if doc
    ]
    return objects + [generate_configmap(directory, gen) for gen in spec["configMapGenerator"]]


def generate_configmap(directory: Path, generator: dict) -> dict:
    assert generator["options"]["disableNameSuffixHash"] is True
    data = {}
    for entry in generator["files"]:
        key, _, path = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (directory / path).read_text()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": generator["name"]},
        "data": data,
    }


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    return by_key(render(K8S))


def containers(obj: dict) -> list[dict]:
    return obj["spec"]["template"]["spec"]["containers"]


def test_every_component_is_there(objects):
    expected = {
        ("ConfigMap", "rlfleet-config"),
        ("PersistentVolumeClaim", "rlfleet-runs"),
        *[
            ("Deployment", n)
            for n in ("redis", "router", "rollout", "reward", "refcritic", "env", "dashboard")
        ],
        *[("Service", n) for n in ("redis", "router", "reward", "refcritic", "env", "trainer")],
        ("Job", "trainer"),
    }
    assert set(objects) == expected


@pytest.mark.parametrize("key", sorted(by_key(render(K8S))), ids=lambda k: f"{k[0]}/{k[1]}")
def test_object_matches_kubernetes_schema(objects, key):
    kubernetes_validate.validate(objects[key], KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on PATH")
def test_kubectl_kustomize_renders_the_same_objects(objects):
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert by_key([doc for doc in yaml.safe_load_all(out) if doc]) == objects


def test_shipped_config_loads_and_names_the_services(objects):
    text = objects[("ConfigMap", "rlfleet-config")]["data"]["rlfleet.yaml"]
    path = K8S / "config" / "rlfleet.yaml"
    assert text == path.read_text()
    config = load_config(str(path), [])
    for role, port in GRPC_ROLES.items():
        assert getattr(config, SECTION.get(role, role)).port == port
        if role == "env":  # the trainer's address of the env role, and the agent gateway
            assert config.agent.address == f"env:{port}" and ("Service", "env") in objects
            assert config.agent.gateway_url == f"http://router:{config.router.http_port}/v1"
        elif role != "rollout":
            assert getattr(config.endpoints, role) == f"{role}:{port}"
            assert ("Service", role) in objects
    assert config.redis_url == "redis://redis:6379/0"
    deployment = objects[("Deployment", "rollout")]
    assert config.trainer.min_replicas == deployment["spec"]["replicas"]


@pytest.mark.parametrize("role", sorted(GRPC_ROLES))
def test_every_role_has_grpc_health_probes_on_its_port(objects, role):
    kind = "Job" if role == "trainer" else "Deployment"
    (container,) = containers(objects[(kind, role)])
    assert container["args"][:2] == ["rlfleet", role]
    assert {"containerPort": GRPC_ROLES[role], "name": "grpc"} in container["ports"]
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == GRPC_ROLES[role]


def test_trainer_is_a_resumable_job_on_the_checkpoint_volume(objects):
    job = objects[("Job", "trainer")]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"rlfleet-runs"}
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    config = load_config(str(K8S / "config" / "rlfleet.yaml"), [])
    assert config.trainer.resume_mode == "auto" and config.trainer.save_freq > 0
    assert any(config.run_dir.startswith(m + "/") for m in mounts)


def test_services_select_the_pods_they_front(objects):
    for (kind, name), service in objects.items():
        if kind != "Service":
            continue
        owner = objects.get(("Deployment", name)) or objects[("Job", name)]
        labels = owner["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
