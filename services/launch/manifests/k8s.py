"""deploy/k8s/: a Deployment (the trainer: a Job) per role of the fleet plan, a Service per
role the others are told about, and the kustomization listing them, rendered from the plan
(``roles.static_roles``) and the config every pod mounts (deploy/k8s/config/rlfleet.yaml).

What is the plan's: which roles there are, their arguments and ports, their replicas (the
env role's 0 until the config names an environment; the rollout replicas the config's
``trainer.min_replicas``), which one is a Job and which Services it waits for, which get a
Service. What is Kubernetes', and written here: probes, resources, volumes, security
contexts, and the prose. redis.yaml, runs-pvc.yaml and config/rlfleet.yaml are not roles of
the plan and stay written by hand.
"""

from __future__ import annotations

import textwrap
from typing import Any

import yaml

from rlfleet.launch.manifests.roles import StaticRole, argv

WIDTH = 96
"""Prose width."""
SHORT_LIST = 64
"""A list of scalars up to this long is written on one line, a longer one an item a line."""
LONG = 1000
"""No text is folded (a shell command reads better on one line)."""
IMAGE = "rlfleet:local"
CONFIG_DIR = "/etc/rlfleet"
CONFIG = f"{CONFIG_DIR}/rlfleet.yaml"
HAND_WRITTEN = ("runs-pvc.yaml", "redis.yaml")
"""The kustomization's resources that are not roles: the run volume and Redis."""
RUN_VOLUME = "rlfleet-runs"
WRITES_RUNS = frozenset({"refcritic", "trainer", "dashboard"})
"""Roles that mount the shared run volume: the trainer's and the critic's checkpoints, the
dashboard's reading of them. The others get a scratch directory."""
SLOW_START = frozenset({"rollout", "trainer"})
"""Roles given twice as long to start (they load the policy into an engine or a trainer)."""
ONE_OWNER = frozenset({"refcritic"})
"""Roles replaced by stopping the old pod first: one critic owner at a time."""
RESOURCES = {
    "router": ("250m", "512Mi", "2Gi"),
    "reward": ("500m", "512Mi", "2Gi"),
    "refcritic": ("1", "2Gi", "6Gi"),
    "rollout": ("1", "3Gi", "6Gi"),
    "env": ("500m", "512Mi", "2Gi"),
    "trainer": ("2", "4Gi", "12Gi"),
    "dashboard": ("100m", "256Mi", "1Gi"),
}
"""(CPU request, memory request, memory limit) per role."""
WAIT_FOR_REDIS = (
    "until python -c \"import redis; redis.Redis.from_url('redis://redis:6379/0', "
    'socket_timeout=2).ping()"; do echo waiting for redis; sleep 2; done'
)
RENDERED = "Rendered from the fleet plan by scripts/render_deploy.py (make deploy): do not edit."
NOTES = {
    "router": """\
The generation front door (gRPC Rollout.Generate + Router, OpenAI-compatible HTTP on {http}).
Its state is in Redis, so `replicas` may be raised; the trainer reaches it as router:{port}.""",
    "reward": """\
The reward service and its workers. Work goes through a Redis stream, so `replicas` scales
scoring; a dead pod's jobs are taken over by a live one.""",
    "refcritic": """\
The frozen reference policy and the critic. It writes critic checkpoints into the shared run
volume (the trainer names the directory), so it mounts `rlfleet-runs` like the trainer.
Replaced by stopping the old pod first (strategy Recreate): one critic owner at a time.""",
    "rollout": """\
Rollout replicas: one inference engine per pod. Scale with `replicas` (or `kubectl scale
deployment/rollout --replicas=N`, also while training runs). Each replica registers its pod
IP in Redis (RLFLEET_ADVERTISE_HOST), so the router reaches it directly and no Service is
needed; a newcomer gets the current weights from the trainer before the router uses it.
The replica id is the pod name, so a restarted container resumes its own request stream.
SYS_NICE: vLLM's CPU backend sets NUMA memory policy; /dev/shm in memory for its worker
queues. For GPUs: add `nvidia.com/gpu: 1` to limits (a patch in an overlay: this file is
rendered) and use an image built with VLLM_SPEC=vllm.""",
    "env": """\
The env role of agent mode: the Env front door and its episode workers. Work goes through the
env stream in Redis, so every pod serves the front door (the `env` Service reaches any of
them) and `replicas` scales episode workers; a dead pod's episodes are restarted by another.
Zero replicas for the default job: set `agent.env` in config/rlfleet.yaml (an agent job, e.g.
configs/compose_agent.yaml's settings), then `kubectl scale deployment/env --replicas=2`.""",
    "trainer": """\
The trainer is a Job: it trains trainer.total_steps steps, writes metrics and checkpoints to
the run volume, and exits 0. A failed container is restarted in place (OnFailure) and, with
trainer.resume_mode=auto, continues from the newest run_dir/checkpoints/global_step_N.
It starts once the Services of the roles the plan starts before it answer their health checks.
The Service exposes its control API (rlfleet status, Pause/Resume/Stop) as trainer:{port}.""",
    "dashboard": """\
The live page of the run (docs/dashboard.md): it probes the other roles by their Service
names and reads the trainer's files (metrics.jsonl, samples) from the run volume. No Service:
the page shows prompts and answers, so it is reached from your machine only, with
  kubectl port-forward deployment/dashboard {port}     # then open http://127.0.0.1:{port}/""",
}
"""Prose at the top of a role's file."""

KUSTOMIZATION = """\
{title}
#
# Rendered from the fleet plan (services/launch/plan.py) and config/rlfleet.yaml by
# scripts/render_deploy.py (services/launch/manifests/k8s.py), like every role's file here:
# edit those and render again; `make test` fails when a file is not what they render.
# redis.yaml, runs-pvc.yaml and config/rlfleet.yaml are written by hand.
#
#   kubectl apply -k deploy/k8s            # or: kubectl kustomize deploy/k8s | kubectl apply -f -
#   kubectl logs -f job/trainer
#   kubectl scale deployment/rollout --replicas=4
#   kubectl delete -k deploy/k8s
#
# The image `rlfleet:local` is the repository's Dockerfile (target `app`); push it to a registry
# your cluster pulls from and point an overlay's `images:` at it. Rendered and schema-checked by
# tests/unit/test_k8s_manifests.py; not run on a live cluster in this repository's CI.
"""


def render(roles: list[StaticRole]) -> dict[str, str]:
    """File name under deploy/k8s/ -> text: kustomization.yaml and one file per role."""
    served = {role.verb: f"{role.verb}:{role.port}" for role in roles if role.address_variable}
    files = {f"{role.verb}.yaml": role_file(role, served) for role in roles}
    spec = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [*HAND_WRITTEN, *files],
        "configMapGenerator": [
            {
                "name": "rlfleet-config",
                "files": ["rlfleet.yaml=config/rlfleet.yaml"],
                "options": {"disableNameSuffixHash": True},
            }
        ],
    }
    title = (
        "rlfleet on Kubernetes, without Ray: Redis and the roles of the fleet plan ("
        + ", ".join(label(role) for role in roles)
        + "), sharing one config (a ConfigMap) and one run volume."
    )
    lines = textwrap.wrap(title, WIDTH, initial_indent="# ", subsequent_indent="# ")
    head = KUSTOMIZATION.format(title="\n".join(lines))
    return {"kustomization.yaml": head + dump(spec), **files}


def label(role: StaticRole) -> str:
    if role.finishes:
        return f"{role.verb} (a Job)"
    return f"{role.verb} ({role.count} replicas)" if role.scalable else role.verb


def role_file(role: StaticRole, served: dict[str, str]) -> str:
    """The role's file: its prose, its workload, its Service if the others are told of it.
    ``served``: verb -> the address of its Service."""
    extra = dict(role.extra_ports)
    note = NOTES[role.verb].format(port=role.port, http=extra.get("http"))
    note += f"\n{RENDERED}"
    head = "".join(f"# {line}".rstrip() + "\n" for line in note.splitlines())
    objects = [workload(role, served)] + ([service(role)] if role.address_variable else [])
    return head + "---\n".join(dump(obj) for obj in objects)


class Dumper(yaml.SafeDumper):
    """Block style with indented lists, flow style for leaves (``{port: 50051}``) and short
    lists of scalars, no anchors, text holding a single quote in double quotes (the shell
    commands) and never folded."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)

    def ignore_aliases(self, data: Any) -> bool:
        return True


def quoted(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, '"' if "'" in text else None)


def listed(dumper: yaml.SafeDumper, items: list[Any]) -> yaml.SequenceNode:
    short = sum(len(str(item)) + 2 for item in items) <= SHORT_LIST
    flow = short and not any(isinstance(item, (dict, list)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


Dumper.add_representer(str, quoted)
Dumper.add_representer(list, listed)


def dump(obj: dict[str, Any]) -> str:
    return yaml.dump(obj, Dumper=Dumper, sort_keys=False, default_flow_style=None, width=LONG)


def labels(verb: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "rlfleet", "app.kubernetes.io/component": verb}


def metadata(verb: str) -> dict[str, Any]:
    return {"name": verb, "labels": labels(verb)}


def workload(role: StaticRole, served: dict[str, str]) -> dict[str, Any]:
    """The role's Deployment, or its Job when it finishes."""
    pod: dict[str, Any] = {"restartPolicy": "OnFailure"} if role.finishes else {}
    pod["securityContext"] = {
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "runAsNonRoot": True,
        "fsGroup": 1000,
    }
    if role.engine:
        pod["terminationGracePeriodSeconds"] = 30
    pod["initContainers"] = [wait(role, served)]
    pod["containers"] = [container(role)]
    pod["volumes"] = volumes(role)
    template = {"metadata": {"labels": labels(role.verb)}, "spec": pod}
    if role.finishes:
        spec = {"backoffLimit": 4, "template": template}
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": metadata(role.verb),
            "spec": spec,
        }
    spec = {"replicas": role.count}
    if role.verb in ONE_OWNER:
        spec["strategy"] = {"type": "Recreate"}
    spec |= {"selector": {"matchLabels": labels(role.verb)}, "template": template}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(role.verb),
        "spec": spec,
    }


def wait(role: StaticRole, served: dict[str, str]) -> dict[str, Any]:
    """Wait for Redis; a role that waits for others waits for the health of those that have a
    Service (the trainer waits for its rollout replicas itself: ``trainer.min_replicas``)."""
    if not role.waits_for:
        return {"name": "wait-for-redis", "image": IMAGE, "command": ["sh", "-c", WAIT_FOR_REDIS]}
    addresses = " ".join(served[verb] for verb in role.waits_for if verb in served)
    loop = (
        f"for a in {addresses}; do until python -m rlfleet.common.grpc_healthcheck $a; "
        "do sleep 5; done; done"
    )
    return {"name": "wait-for-services", "image": IMAGE, "command": ["sh", "-c", loop]}


def container(role: StaticRole) -> dict[str, Any]:
    main = "http" if role.http else "grpc"
    spec: dict[str, Any] = {
        "name": role.verb,
        "image": IMAGE,
        "args": argv(role, CONFIG, "$(POD_NAME)"),
    }
    if role.advertise_key:
        spec["env"] = [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "RLFLEET_ADVERTISE_HOST",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            },
        ]
    ports = [(main, role.port), *role.extra_ports]
    spec["ports"] = [{"name": name, "containerPort": port} for name, port in ports]
    spec |= probes(role, main)
    cpu, memory, limit = RESOURCES[role.verb]
    spec["resources"] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": limit}}
    if role.engine:
        spec["securityContext"] = {"capabilities": {"add": ["SYS_NICE"]}}
    spec["volumeMounts"] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "runs" if role.verb in WRITES_RUNS else "scratch", "mountPath": "/runs"},
    ] + ([{"name": "dshm", "mountPath": "/dev/shm"}] if role.engine else [])
    return spec


def probes(role: StaticRole, main: str) -> dict[str, Any]:
    """Start-up and liveness on its main port; readiness where a Service or the router picks
    pods by it (not for a Job, nor for the dashboard, which nothing routes to)."""
    check = (
        {"httpGet": {"path": "/healthz", "port": main}}
        if role.http
        else {"grpc": {"port": role.port}}
    )
    started = {
        **check,
        "periodSeconds": 5,
        "failureThreshold": 120 if role.verb in SLOW_START else 60,
    }
    quiet = role.finishes or role.http
    probes = {"startupProbe": started}
    if not quiet:
        probes["readinessProbe"] = {**check, "periodSeconds": 5}
    live = (15, 4) if quiet else (10, 3)
    probes["livenessProbe"] = {**check, "periodSeconds": live[0], "failureThreshold": live[1]}
    return probes


def volumes(role: StaticRole) -> list[dict[str, Any]]:
    own = (
        {"name": "runs", "persistentVolumeClaim": {"claimName": RUN_VOLUME}}
        if role.verb in WRITES_RUNS
        else {"name": "scratch", "emptyDir": {}}
    )
    shm = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]
    return [{"name": "config", "configMap": {"name": "rlfleet-config"}}, own] + (
        shm if role.engine else []
    )


def service(role: StaticRole) -> dict[str, Any]:
    ports = [{"name": "grpc", "port": role.port, "targetPort": "grpc", "appProtocol": "grpc"}]
    ports += [
        {"name": name, "port": port, "targetPort": name}
        for name, port in role.extra_ports
        if name == "http"  # a front door; metrics are scraped from each pod
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(role.verb),
        "spec": {"selector": labels(role.verb), "ports": ports},
    }
