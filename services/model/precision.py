"""Whether bf16 matmuls are fast on this machine: the rule behind ``autocast_dtype: auto``.

bf16 autocast speeds a CPU's forward and backward only where the CPU multiplies bf16 in
hardware (Intel AMX, AVX-512 BF16): measured on SmolLM2-135M, fwd+bwd of 16 rows x 100 tokens
took 1.6x less time under bf16 on an AMX CPU, and 2.6x MORE on a machine of the same kind
without AMX or AVX-512 BF16 (bf16 emulated: 16 s forward vs 8.5 s in fp32). GPUs that torch
runs bf16 on all do it in hardware. The same rule picks the engines' dtype where
``rollout.dtype`` is ``auto`` (``serving_dtype``).
"""

from __future__ import annotations

from pathlib import Path

BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})
"""/proc/cpuinfo flags of CPUs with bf16 matrix instructions."""


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first processor listed in ``/proc/cpuinfo``'s text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def fast_bf16(device_type: str, cpuinfo_path: str = "/proc/cpuinfo") -> bool:
    """True on a GPU, or on a CPU whose flags include bf16 matrix instructions."""
    if device_type != "cpu":
        return True
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:  # not Linux: no way to tell, so no autocast (fp32 is never slower there)
        return False
    return bool(cpu_flags(text) & BF16_CPU_FLAGS)


def serving_dtype(model_dtype: str, rollout_dtype: str | None, device_type: str) -> str:
    """The dtype a rollout engine holds its parameters in (``rollout.dtype``): ``model_dtype``
    when none is set, bfloat16 for ``auto`` where bf16 is fast on ``device_type``."""
    if rollout_dtype is None:
        return model_dtype
    if rollout_dtype == "auto":
        return "bfloat16" if fast_bf16(device_type) else model_dtype
    return rollout_dtype
