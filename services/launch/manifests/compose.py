"""docker-compose.yml, rendered from the fleet plan (``roles.static_roles``) and the config
every container mounts (configs/compose.yaml).

What is the plan's: which services run Python roles, their commands, ports and health checks,
which are scaled and which are off (``scale: 0``), which one is a job (``restart: "no"``) and
what it waits for, and the ``RLFLEET_*_ADDR`` variables that tell every role where the others
serve. What is compose's, and written here: the image and its build, Redis, the volumes, the
ports published on the host, and the prose. Compose file format 2.4 (Compose v1 and v2 read
it), anchors for what every role shares.
"""

from __future__ import annotations

import textwrap

from rlfleet.launch.manifests.roles import StaticRole, argv

CONFIG = "configs/compose.yaml"
IDENTITY = "rollout-$$(hostname)"
"""A copy's id: its container's host name, kept across restarts of the container."""
PUBLISHED = {"router": "${RLFLEET_PUBLISH_HOST:-127.0.0.1}", "dashboard": "127.0.0.1"}
"""Roles whose port the host sees, on which address: the router's gRPC front door (beyond
this machine only when asked), the dashboard's page (this machine only: it shows prompts)."""
WIDTH = 100
ONE_LINE = 110
"""The longest ``command:`` line left unfolded."""

HEADER = """\
{roles}
#
# Rendered from the fleet plan (services/launch/plan.py) and {config} by
# scripts/render_deploy.py (services/launch/manifests/compose.py): edit those and render
# again, not this file; `make test` fails when it is not what they render.
#
#   docker-compose up -d --scale rollout=2        # build the images, start the fleet, train
#   docker-compose logs -f trainer                # watch training; the trainer exits when done
#   docker-compose down -v                        # stop everything, delete the volumes
#
# File format 2.4 so Compose v1 (1.29, what Debian 12 ships) and Compose v2 both read it, with
# `depends_on: condition: service_healthy`. Every role uses the same image and the same config
# file ({config}); extra dotted overrides per role come from RLFLEET_<ROLE>_ARGS,
# e.g. RLFLEET_TRAINER_ARGS="trainer.total_steps=300".
#
# Security: Redis needs a password, from the environment (nothing secret is committed):
#   export RLFLEET_REDIS_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
# (hex, so it needs no escaping in the redis:// URL). `up` refuses to start without it. The
# services talk over the compose network; the ports published on the host are the router's
# gRPC port, on 127.0.0.1 and an ephemeral host port unless you choose one:
# RLFLEET_ROUTER_HOST_PORT=50051 (`docker-compose port router 50051` shows it);
# RLFLEET_PUBLISH_HOST=0.0.0.0 exposes it beyond this machine (then set RLFLEET_API_KEY);
# and the dashboard's page, on 127.0.0.1 only (it shows prompts and answers):
# RLFLEET_DASHBOARD_HOST_PORT=8265, or `docker-compose port dashboard 8265`.
#
# Durability: Redis writes an append-only file (AOF, fsync every second) to its own volume,
# so restarting it (`docker-compose restart redis`, a crash, a host reboot) loses no queued
# work, answer or registry entry (at most ~1 s of writes on a hard crash); the services
# reconnect on their own (docs/failure_semantics.md, "Redis outages").
#
# Images: RLFLEET_BASE_IMAGE is the Dockerfile's base (default python:3.11-slim; offline
# machines use a debootstrapped Debian, see scripts/compose_test.sh). Redis is built from the
# same base (target `redis`) so nothing has to be pulled; to use the official image instead,
# `docker pull redis:7` and set RLFLEET_REDIS_IMAGE=redis:7 (an existing image is not rebuilt).
version: "2.4"

x-build: &build
  context: .
  args:
    BASE_IMAGE: ${{RLFLEET_BASE_IMAGE:-python:3.11-slim}}

x-env: &env
  RLFLEET_REDIS_URL: redis://:${{RLFLEET_REDIS_PASSWORD:?set RLFLEET_REDIS_PASSWORD (see the top of docker-compose.yml)}}@redis:6379/0
  RLFLEET_CLUSTER: ${{RLFLEET_CLUSTER:-compose}}
  RLFLEET_RUN_DIR: /runs/${{RLFLEET_CLUSTER:-compose}}
{addresses}
  RLFLEET_API_KEY: ${{RLFLEET_API_KEY:-}}
  RLFLEET_ROLLOUT_BACKEND: ${{RLFLEET_ROLLOUT_BACKEND:-}}

# What every Python role shares. The health check asks grpc.health.v1 for SERVING.
x-role: &role
  image: ${{RLFLEET_IMAGE:-rlfleet:local}}
  build:
    <<: *build
    target: app
  init: true
  environment: *env
  volumes:
    - runs:/runs
  restart: unless-stopped
  stop_grace_period: 30s
  depends_on:
    redis:
      condition: service_healthy

x-health: &health
  interval: 5s
  timeout: 10s
  retries: 60
  start_period: 10s

services:
  redis:
    image: ${{RLFLEET_REDIS_IMAGE:-rlfleet-redis:local}}
    build:
      <<: *build
      target: redis
    # Reachable only on the compose network, password required; AOF with fsync every second
    # (lossless restarts); noeviction: queued work is never silently dropped (a full server
    # refuses writes instead). The password travels in the environment, not in this file.
    command:
      - sh
      - -c
      - >-
        exec redis-server --bind 0.0.0.0 --protected-mode yes
        --requirepass "$$RLFLEET_REDIS_PASSWORD" --dir /var/lib/redis --save ""
        --appendonly yes --appendfsync everysec
        --maxmemory $${{RLFLEET_REDIS_MAXMEMORY:-1gb}} --maxmemory-policy noeviction
    environment:
      RLFLEET_REDIS_PASSWORD: ${{RLFLEET_REDIS_PASSWORD:?set RLFLEET_REDIS_PASSWORD}}
      REDISCLI_AUTH: ${{RLFLEET_REDIS_PASSWORD:?set RLFLEET_REDIS_PASSWORD}}
      RLFLEET_REDIS_MAXMEMORY: ${{RLFLEET_REDIS_MAXMEMORY:-1gb}}
    volumes:
      - redis-data:/var/lib/redis
    restart: unless-stopped
    stop_grace_period: 30s
    healthcheck:
      test: ["CMD-SHELL", "redis-cli ping | grep -q PONG"]
      interval: 2s
      timeout: 5s
      retries: 30
"""

FOOTER = """
volumes:
  runs:
  redis-data:
"""

NOTES = {
    "rollout": """\
Scalable: no container_name, no host port. Each replica advertises its own container
hostname (which the compose network resolves) in Redis and takes it as its id (a restarted
container resumes its own request stream), so `--scale rollout=N` just works.
SYS_NICE lets vLLM's CPU backend set NUMA memory policy; shm for its worker queues.""",
    "env": """\
The env role of agent mode (agent.env set: configs/compose_agent.yaml): the Env front door
and its episode workers. Scalable like rollout: every container serves the front door on
the same port (`env:{port}` reaches any of them) and they share the env stream in Redis, so
`--scale env=N` adds episode workers. Not started for the default job (scale 0):
  RLFLEET_CONFIG=configs/compose_agent.yaml docker-compose up -d --scale rollout=2 --scale env=2""",
    "trainer": """\
A job, not a server: trains trainer.total_steps steps, writes metrics.jsonl and the final
checkpoint into the runs volume, and exits (0 on success). It starts once the roles the
plan starts before it are healthy.""",
    "dashboard": """\
The live page of the run (docs/dashboard.md): it probes the other roles by their compose
names and reads the trainer's files (metrics.jsonl, samples) from the shared runs volume.
It binds 0.0.0.0 inside its container; the host sees it on 127.0.0.1 only.""",
}
"""Prose above a service, where it needs any."""


def render(roles: list[StaticRole]) -> str:
    """The whole docker-compose.yml for ``roles`` (``static_roles`` of configs/compose.yaml)."""
    names = ", ".join(role_label(role) for role in roles)
    title = f"rlfleet as containers: redis and the roles of the fleet plan ({names})."
    title_lines = textwrap.wrap(title, WIDTH - 2, initial_indent="# ", subsequent_indent="# ")
    addresses = [
        f"  {role.address_variable}: {role.verb}:{role.port}"
        for role in roles
        if role.address_variable
    ]
    head = HEADER.format(
        roles="\n".join(title_lines), config=CONFIG, addresses="\n".join(addresses)
    )
    body = "".join("\n" + "\n".join(service(role)) + "\n" for role in roles)
    return head + body + FOOTER


def role_label(role: StaticRole) -> str:
    if not role.scalable:
        return role.verb
    return f"{role.verb} (scalable{', off until scaled up' if role.count == 0 else ''})"


def service(role: StaticRole) -> list[str]:
    """One role's service: its command, published port, engine needs, scale, health, order."""
    lines = [*comment(NOTES.get(role.verb, "").format(port=role.port))]
    lines += [f"  {role.verb}:", "    <<: *role", *command(role)]
    if role.verb in PUBLISHED:
        host_port = f"${{RLFLEET_{role.verb.upper()}_HOST_PORT:-}}"
        lines += ["    ports:", f'      - "{PUBLISHED[role.verb]}:{host_port}:{role.port}"']
    if role.engine:
        lines += ["    shm_size: 1gb", "    cap_add: [SYS_NICE]"]
    if role.count == 0:
        lines.append("    scale: 0")
    if role.finishes:
        lines.append('    restart: "no"')  # nothing waits on a job's health
    else:
        lines += ["    healthcheck:", "      <<: *health", *health_test(role)]
    if role.waits_for:
        lines.append("    depends_on:")
        for verb in ("redis", *role.waits_for):
            lines += [f"      {verb}:", "        condition: service_healthy"]
    return lines


def comment(text: str) -> list[str]:
    return [f"  # {line}".rstrip() for line in text.splitlines()]


def command(role: StaticRole) -> list[str]:
    """``rlfleet VERB --config ... OVERRIDES $RLFLEET_VERB_ARGS``; through ``sh -c`` where the
    container's host name goes in, folded where it is long."""
    argv = [*role_argv(role), f"${{RLFLEET_{role.verb.upper()}_ARGS:-}}"]
    line = " ".join(argv)
    if "$$(" in line:
        line = f"sh -c 'exec {line}'"
    if len(line) + len("    command: ") <= ONE_LINE:
        return [f"    command: {line}"]
    wrapped = textwrap.wrap(line, WIDTH - 8, break_long_words=False, break_on_hyphens=False)
    return ["    command: >-", *("      " + part for part in wrapped)]


def role_argv(role: StaticRole) -> list[str]:
    words = argv(role, f"${{RLFLEET_CONFIG:-{CONFIG}}}", IDENTITY)
    if role.advertise_key:
        words.append(f"{role.advertise_key}=$$(hostname)")
    return words


def health_test(role: StaticRole) -> list[str]:
    if not role.http:
        probe = f"127.0.0.1:{role.port}"
        return [
            f'      test: ["CMD", "python", "-m", "rlfleet.common.grpc_healthcheck", "{probe}"]'
        ]
    url = f"http://127.0.0.1:{role.port}/healthz"
    return [
        '      test: ["CMD", "python", "-c",',
        f"             \"import urllib.request; urllib.request.urlopen('{url}', timeout=5)\"]",
    ]
