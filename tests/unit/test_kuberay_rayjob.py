"""The KubeRay example (deploy/kuberay/rayjob.yaml) parses, runs `rlfleet up --ray` with
overrides the config accepts, and its pod templates match Kubernetes' core/v1 schema.

kubernetes-validate knows no CRDs, so the RayJob itself is checked field by field here, and
each embedded pod template is validated as the template of a core/v1 ``PodTemplate`` (strict:
unknown fields fail). Not run on a live cluster in this repository's CI.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from rlfleet.common.config import load_config
from rlfleet.launch.up import parse_args

ROOT = Path(__file__).resolve().parents[2]
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32"


@pytest.fixture(scope="module")
def rayjob() -> dict:
    (job,) = [doc for doc in yaml.safe_load_all(RAYJOB.read_text()) if doc]
    return job


def templates(job: dict) -> dict[str, dict]:
    cluster = job["spec"]["rayClusterSpec"]
    found = {"head": cluster["headGroupSpec"]["template"]}
    found.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return found


def test_it_is_a_rayjob_that_tears_its_cluster_down(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "InteractiveMode")
    pinned = [
        line
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.startswith("ray==")
    ]
    assert pinned == [f"ray=={spec['rayClusterSpec']['rayVersion']}"]
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_entrypoint_is_rlfleet_up_on_ray_with_a_valid_config(rayjob):
    argv = shlex.split(rayjob["spec"]["entrypoint"])
    assert argv[:2] == ["rlfleet", "up"]
    args = parse_args(argv[2:])
    assert args.ray == "auto" and args.config == "/etc/rlfleet/rlfleet.yaml"
    # the config the pods mount (deploy/k8s/config) with the entrypoint's overrides
    config = load_config(K8S / "config" / "rlfleet.yaml", args.overrides)
    assert config.redis_url, "a fleet across pods needs a shared Redis, not an embedded one"
    assert config.trainer.resume_mode == "auto" and config.trainer.save_freq > 0


@pytest.mark.parametrize("group", ["head", "cpu"])
def test_pod_templates_match_the_core_v1_schema(rayjob, group):
    template = templates(rayjob)[group]
    wrapped = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": group},
        "template": template,
    }
    kubernetes_validate.validate(wrapped, KUBERNETES_VERSION, strict=True)


def test_pods_mount_the_config_and_run_volume_deploy_k8s_defines(rayjob):
    pvc = yaml.safe_load((K8S / "runs-pvc.yaml").read_text())["metadata"]["name"]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    config_map = kustomization["configMapGenerator"][0]["name"]
    for template in templates(rayjob).values():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["config"]["configMap"]["name"] == config_map
        assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == pvc
        mounts = {m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]}
        assert {"/etc/rlfleet", "/runs"} <= mounts
