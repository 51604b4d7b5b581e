"""The static deployments, rendered from the fleet plan: docker-compose.yml and deploy/k8s/.

``rlfleet up`` (local processes), ``rlfleet up --ray`` and ``rlfleet slurm`` start what
``rlfleet.launch.plan.plan_fleet`` lists; the compose file and the Kubernetes manifests are
that plan written down for the config each ships (configs/compose.yaml,
deploy/k8s/config/rlfleet.yaml): ``roles`` reads the plan, ``compose`` and ``k8s`` write the
files. ``scripts/render_deploy.py`` writes them; ``--check`` (run by ``make test``, and by
tests/unit/test_deploy_render.py) fails when a committed file is not what they render.
"""

from __future__ import annotations

from pathlib import Path

from rlfleet.common.config import load_config
from rlfleet.launch.manifests import compose, k8s
from rlfleet.launch.manifests.roles import static_roles

COMPOSE_FILE = "docker-compose.yml"
K8S_DIR = "deploy/k8s"
K8S_CONFIG = f"{K8S_DIR}/config/rlfleet.yaml"


def rendered(root: Path) -> dict[str, str]:
    """Path relative to the repository ``root`` -> the text the plan renders there. The
    configs are read without ``RLFLEET_*`` variables: a file renders the same in any shell."""
    compose_config = load_config(root / compose.CONFIG, [], env={})
    k8s_config = load_config(root / K8S_CONFIG, [], env={})
    files = {COMPOSE_FILE: compose.render(static_roles(compose_config))}
    for name, text in k8s.render(static_roles(k8s_config)).items():
        files[f"{K8S_DIR}/{name}"] = text
    return files


def stale(root: Path) -> list[str]:
    """The rendered files whose committed text differs (or that are missing), sorted."""
    return sorted(
        path
        for path, text in rendered(root).items()
        if not (root / path).is_file() or (root / path).read_text() != text
    )
