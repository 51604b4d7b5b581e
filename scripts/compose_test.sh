#!/usr/bin/env bash
# End-to-end test of the docker compose deployment (what `make compose-test` runs).
#
# Why a script and not a pytest: it needs a Docker Engine, and on the project's machines there
# is none until we start one. It installs Docker Engine + Compose v1 + debootstrap from apt when
# missing, starts its own dockerd (state under .docker-test/, so images and build cache survive
# between runs) unless a usable one is already running, builds a Debian base image with
# debootstrap when no registry can be pulled from, builds the project image, brings the fleet
# up with two rollout replicas, waits for the trainer to finish, and checks in Redis that both
# replicas served requests. It always tears down (`down -v`) and stops only the dockerd it
# started, and puts back the firewall rules and the docker0 bridge that dockerd changed
# (scripts/host_state.sh). Every phase is timed.
#
# Knobs (environment):
#   COMPOSE_TEST_STEPS=3          trainer.total_steps for the run
#   COMPOSE_TEST_REPLICAS=2       rollout replicas (--scale rollout=N); the check needs >= 2
#   COMPOSE_TEST_TIMEOUT=1200     seconds to wait for the trainer to exit
#   COMPOSE_TEST_TRAINER_ARGS=    extra dotted overrides for the trainer
#   COMPOSE_TEST_KEEP_DAEMON=1    leave a dockerd this script started running (development)
#   COMPOSE_TEST_PROJECT=rlfleet-test   compose project name (never a real deployment's)
#   RLFLEET_BASE_IMAGE=...        base image; default: a registry image if one can be pulled,
#                                 else local/debian:bookworm made with debootstrap
#   RLFLEET_DOCKER_STATE=DIR      engine state directory (default: <repo>/.docker-test)
# Argument --build-only: stop after building the images (still stops its dockerd).
set -euo pipefail

export PATH="/usr/sbin:/usr/bin:/sbin:/bin:${PATH}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${RLFLEET_DOCKER_STATE:-${ROOT}/.docker-test}"
STEPS="${COMPOSE_TEST_STEPS:-3}"
REPLICAS="${COMPOSE_TEST_REPLICAS:-2}"
TIMEOUT="${COMPOSE_TEST_TIMEOUT:-1200}"
CLUSTER="${RLFLEET_CLUSTER:-compose}"
LOCAL_BASE="local/debian:bookworm"
# A project name of its own: `down -v` at the end must never touch a real deployment's volumes.
export COMPOSE_PROJECT_NAME="${COMPOSE_TEST_PROJECT:-rlfleet-test}"
export COMPOSE_FILE="${ROOT}/docker-compose.yml"
export COMPOSE_HTTP_TIMEOUT=300
export RLFLEET_TRAINER_ARGS="trainer.total_steps=${STEPS} trainer.min_replicas=${REPLICAS} ${COMPOSE_TEST_TRAINER_ARGS:-}"
# docker-compose.yml requires a Redis password from the environment: a fresh one per run.
export RLFLEET_REDIS_PASSWORD="${RLFLEET_REDIS_PASSWORD:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"

# shellcheck source=scripts/host_state.sh
source "${ROOT}/scripts/host_state.sh"
HOST_BEFORE="${STATE}/host-before"
HOST_SAVED=0

STARTED_DOCKERD_PID=""
COMPOSE_UP=0
RESULT="FAIL"
T_START=$(date +%s)
PHASE_NAME=""
PHASE_T0=0
TIMINGS=()

log() { printf '[compose-test %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

phase() {
    # End the running phase (recording its duration) and start the next one.
    local now
    now=$(date +%s)
    if [[ -n "${PHASE_NAME}" ]]; then
        TIMINGS+=("$(printf '%-26s %5ds' "${PHASE_NAME}" $((now - PHASE_T0)))")
    fi
    PHASE_NAME="$1"
    PHASE_T0=${now}
    [[ -n "$1" ]] && log "== $1"
    return 0
}

ensure_tools() {
    # dockerd (docker.io), docker-compose v1 and debootstrap from Debian's own packages.
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    [[ -x /usr/bin/docker ]] || missing+=(docker.io)
    command -v docker-compose >/dev/null || missing+=(docker-compose)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if ((${#missing[@]})); then
        log "installing ${missing[*]} with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >/dev/null ||
            { apt-get update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >/dev/null; }
    fi
    log "$(docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /')"
}

docker_ok() { timeout 10 docker info >/dev/null 2>&1; }

use_existing_daemon() {
    # Any engine we can already talk to: $DOCKER_HOST, the system socket, or ours left running.
    if [[ -n "${DOCKER_HOST:-}" ]] && docker_ok; then
        log "using the Docker Engine at DOCKER_HOST=${DOCKER_HOST} (not started here)"
        return 0
    fi
    local sock
    for sock in /var/run/docker.sock "${STATE}/docker.sock"; do
        if [[ -S "${sock}" ]] && DOCKER_HOST="unix://${sock}" docker_ok; then
            export DOCKER_HOST="unix://${sock}"
            log "using the running Docker Engine at ${DOCKER_HOST} (not started here; left running)"
            return 0
        fi
    done
    return 1
}

exec_root() {
    # containerd's socket paths must stay under ~100 bytes; fall back to /tmp for deep repos.
    local dir="${STATE}/exec"
    if ((${#dir} > 60)); then
        dir="/tmp/rlfleet-docker-exec-$(printf '%s' "${STATE}" | md5sum | cut -c1-8)"
    fi
    printf '%s' "${dir}"
}

start_daemon() {
    mkdir -p "${STATE}/engine"
    # dockerd rewrites iptables (its chains, FORWARD DROP) and adds docker0: record the host first.
    host_state_save "${HOST_BEFORE}"
    HOST_SAVED=1
    rm -f "${STATE}/docker.sock" "${STATE}/dockerd.pid"
    dockerd --data-root "${STATE}/engine" --exec-root "$(exec_root)" \
        --pidfile "${STATE}/dockerd.pid" --host "unix://${STATE}/docker.sock" \
        >"${STATE}/dockerd.log" 2>&1 &
    STARTED_DOCKERD_PID=$!
    export DOCKER_HOST="unix://${STATE}/docker.sock"
    local i
    for i in $(seq 1 120); do
        docker_ok && { log "started dockerd (pid ${STARTED_DOCKERD_PID}, state ${STATE})"; return 0; }
        kill -0 "${STARTED_DOCKERD_PID}" 2>/dev/null || break
        sleep 0.5
    done
    log "dockerd did not come up; last lines of ${STATE}/dockerd.log:"
    tail -20 "${STATE}/dockerd.log" || true
    return 1
}

stop_daemon() {
    [[ -n "${STARTED_DOCKERD_PID}" ]] || return 0
    if [[ "${COMPOSE_TEST_KEEP_DAEMON:-0}" == 1 ]]; then
        log "leaving dockerd pid ${STARTED_DOCKERD_PID} running (COMPOSE_TEST_KEEP_DAEMON=1), and its firewall rules"
        return 0
    fi
    terminate_daemon
    restore_host
}

terminate_daemon() {
    kill -TERM "${STARTED_DOCKERD_PID}" 2>/dev/null || return 0
    local i
    for i in $(seq 1 60); do
        kill -0 "${STARTED_DOCKERD_PID}" 2>/dev/null || { log "stopped dockerd pid ${STARTED_DOCKERD_PID}"; return 0; }
        sleep 0.5
    done
    log "dockerd pid ${STARTED_DOCKERD_PID} ignored SIGTERM for 30 s; sending SIGKILL"
    kill -KILL "${STARTED_DOCKERD_PID}" 2>/dev/null || true
    sleep 1
}

restore_host() {
    # After the daemon is gone (it would rewrite its rules): the firewall and bridge as found.
    ((HOST_SAVED)) || return 0
    host_state_restore "${HOST_BEFORE}" || log "the host's firewall may differ from before the test"
    HOST_SAVED=0
}

debian_mirror() {
    # The Debian mirror this machine's apt uses (debootstrap needs one), else the public one.
    local url
    url=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
        grep -v security | head -1 | tr -d ' ' || true)
    printf '%s' "${url:-http://deb.debian.org/debian}"
}

unmount_under() {
    # An interrupted debootstrap can leave /proc or /sys mounted inside its target.
    local target
    for target in $(awk -v root="$1/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r); do
        umount -l "${target}" || true
    done
}

build_local_base() {
    # A Debian bookworm minbase root filesystem, imported as an image (no registry needed).
    if docker image inspect "${LOCAL_BASE}" >/dev/null 2>&1; then
        log "base image ${LOCAL_BASE} already present (cached)"
        return 0
    fi
    local rootfs="${STATE}/rootfs" mirror
    mirror=$(debian_mirror)
    unmount_under "${rootfs}"
    rm -rf --one-file-system "${rootfs}"
    log "debootstrap --variant=minbase bookworm from ${mirror}"
    debootstrap --variant=minbase bookworm "${rootfs}" "${mirror}" >"${STATE}/debootstrap.log" 2>&1 ||
        { tail -20 "${STATE}/debootstrap.log"; return 1; }
    rm -rf "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/*
    tar -C "${rootfs}" -c . | docker import \
        -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "${LOCAL_BASE}" >/dev/null || return 1
    rm -rf --one-file-system "${rootfs}"
    log "imported ${LOCAL_BASE}"
}

choose_base_image() {
    if [[ -n "${RLFLEET_BASE_IMAGE:-}" ]]; then
        docker image inspect "${RLFLEET_BASE_IMAGE}" >/dev/null 2>&1 ||
            timeout 120 docker pull "${RLFLEET_BASE_IMAGE}" >/dev/null 2>&1 ||
            { [[ "${RLFLEET_BASE_IMAGE}" == "${LOCAL_BASE}" ]] && build_local_base; }
    elif docker image inspect python:3.11-slim >/dev/null 2>&1 ||
        timeout 60 docker pull python:3.11-slim >/dev/null 2>&1; then
        export RLFLEET_BASE_IMAGE=python:3.11-slim
    else
        log "no registry image can be pulled; using a debootstrapped Debian base"
        build_local_base
        export RLFLEET_BASE_IMAGE="${LOCAL_BASE}"
    fi
    log "base image: ${RLFLEET_BASE_IMAGE}"
}

stage_local_wheels() {
    # torch==2.13.0+cpu is not on PyPI: pass a local wheel into the build context when pip here
    # knows one (find-links); the Dockerfile falls back to PyTorch's CPU index without it.
    local dir wheel
    rm -rf "${STATE}/wheels"
    mkdir -p "${STATE}/wheels"
    for dir in ${PIP_FIND_LINKS:-} $(pip3 config get global.find-links 2>/dev/null || true) /opt/wheels; do
        for wheel in "${dir}"/torch-2.13.0+cpu-*.whl; do
            [[ -f "${wheel}" ]] || continue
            ln "${wheel}" "${STATE}/wheels/" 2>/dev/null || cp "${wheel}" "${STATE}/wheels/"
            log "build context gets local wheel ${wheel}"
            return 0
        done
    done
    log "no local torch wheel; the image build takes torch from PyTorch's CPU index"
}

stage_extra_cas() {
    # CAs added to this machine's trust store (e.g. a TLS-intercepting egress proxy): the image
    # build needs them to reach PyPI. Only the build stage that runs pip trusts them.
    rm -rf "${STATE}/extra-ca"
    mkdir -p "${STATE}/extra-ca"
    local cert
    for cert in /usr/local/share/ca-certificates/*.crt; do
        [[ -f "${cert}" ]] || continue
        cp "${cert}" "${STATE}/extra-ca/"
        log "build context gets CA certificate ${cert}"
    done
}

build_images() {
    # Redis first, before the 190 MB wheel joins the build context; one build serves every
    # Python role (they share the image). A user-chosen Redis image is used as it is.
    rm -rf "${STATE}/wheels" "${STATE}/extra-ca"
    if [[ -z "${RLFLEET_REDIS_IMAGE:-}" ]]; then
        docker-compose build --force-rm redis
    fi
    stage_local_wheels
    stage_extra_cas
    docker-compose build --force-rm trainer
    docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^rlfleet' || true
}

compose_up() {
    COMPOSE_UP=1
    docker-compose up -d --no-build --scale "rollout=${REPLICAS}"
    docker-compose ps
}

wait_trainer() {
    # Exit status of the trainer container; 124 when it runs past the timeout.
    local id code
    id=$(docker-compose ps -q trainer)
    [[ -n "${id}" ]] || { log "no trainer container"; return 1; }
    code=$(timeout "${TIMEOUT}" docker wait "${id}") || code=124
    log "trainer exited with ${code}"
    docker-compose logs --no-color --tail=25 trainer || true
    [[ "${code}" == 0 ]]
}

redis_cli() { docker-compose exec -T redis redis-cli --raw "$@"; }

check_replicas_served() {
    # Every replica registers in Redis and counts what it served; two of them (or all, when
    # fewer were started) must have done work, or the router did not spread the load.
    local ids id served busy=0 need=$((REPLICAS < 2 ? REPLICAS : 2))
    ids=$(redis_cli SMEMBERS "rlfleet:${CLUSTER}:replicas" | tr -d '\r')
    for id in ${ids}; do
        served=$(redis_cli HGET "rlfleet:${CLUSTER}:replica:${id}" served | tr -d '\r')
        log "replica ${id}: served=${served:-none}"
        [[ "${served:-0}" =~ ^[0-9]+$ ]] && ((served > 0)) && busy=$((busy + 1))
    done
    log "${busy} replica(s) served requests (need >= ${need})"
    ((busy >= need))
}

check_outputs() {
    # The trainer wrote one metrics line per step and a checkpoint into the runs volume.
    docker-compose run --rm --no-deps -e "STEPS=${STEPS}" --entrypoint sh trainer -c '
        cd "$RLFLEET_RUN_DIR" && ls -la . && find checkpoints -type f | sort
        lines=$(wc -l < metrics.jsonl) && echo "metrics.jsonl: $lines lines"
        test "$lines" -ge "$STEPS" || { echo "expected >= $STEPS metrics lines"; exit 1; }
        find . -name "*.safetensors" | grep -q . || { echo "no checkpoint weights"; exit 1; }'
}

dump_logs() {
    log "container states and recent logs:"
    docker-compose ps || true
    docker-compose logs --no-color --tail=40 || true
}

teardown() {
    local status=$?
    trap - EXIT INT TERM
    phase "teardown"
    if ((COMPOSE_UP)); then
        [[ "${RESULT}" == PASS ]] || dump_logs
        docker-compose down -v --remove-orphans --timeout 20 || true
    fi
    stop_daemon
    phase ""
    log "timings:"
    printf '  %s\n' "${TIMINGS[@]}"
    log "total $(($(date +%s) - T_START))s"
    log "${RESULT}"
    [[ "${RESULT}" == PASS ]] && exit 0
    exit $((status ? status : 1))
}

main() {
    mkdir -p "${STATE}"
    trap teardown EXIT
    trap 'exit 130' INT TERM
    phase "tools"
    ensure_tools
    phase "docker engine"
    use_existing_daemon || start_daemon
    phase "base image"
    choose_base_image
    phase "image build"
    build_images
    if [[ "${1:-}" == --build-only ]]; then RESULT="PASS"; return 0; fi
    phase "fleet up (healthy)"
    compose_up
    phase "training (${STEPS} steps)"
    wait_trainer
    phase "checks"
    check_replicas_served
    check_outputs
    RESULT="PASS"
}

main "$@"
