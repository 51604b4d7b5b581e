"""Render docker-compose.yml and deploy/k8s/ from the fleet plan (``rlfleet.launch.manifests``).

Why generated: the compose file and the Kubernetes manifests run the roles ``rlfleet up``
runs, in its order, with its ports; written by hand they drifted from the plan (every new role
added once per backend). Edit services/launch/plan.py, the renderers in
services/launch/manifests/, or the config a deployment ships (configs/compose.yaml,
deploy/k8s/config/rlfleet.yaml), then run this. ``--check`` writes nothing and fails when a
committed file is not what they render (``make test`` runs it, as it runs gen_proto.py --check).

Usage: ``python scripts/render_deploy.py [--check]`` (``make deploy`` / ``make deploy-check``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlfleet.launch.manifests import rendered, stale

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a committed file differs")
    args = parser.parse_args()
    if args.check:
        if names := stale(ROOT):
            print("not what the fleet plan renders (run scripts/render_deploy.py):")
            print("\n".join(f"  {name}" for name in names))
            return 1
        print("docker-compose.yml and deploy/k8s/ are what the fleet plan renders")
        return 0
    for path, text in rendered(ROOT).items():
        (ROOT / path).write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
