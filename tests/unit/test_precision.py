"""``autocast_dtype: auto``: bf16 only where this machine multiplies bf16 in hardware."""

from __future__ import annotations

from rlfleet.model.precision import cpu_flags, fast_bf16

AMX = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile\nbogomips\t: 1\n"
AVX512_ONLY = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"


def test_flags_are_read_from_cpuinfo():
    assert cpu_flags(AMX) == {"fpu", "sse", "avx512f", "amx_bf16", "amx_tile"}
    assert cpu_flags("no flags here") == set()


def test_bf16_is_fast_with_amx_or_a_gpu_and_not_on_plain_avx512(tmp_path):
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text(AMX)
    plain.write_text(AVX512_ONLY)
    assert fast_bf16("cpu", str(amx))
    assert not fast_bf16("cpu", str(plain))  # emulated bf16: 2-3x slower than fp32
    assert not fast_bf16("cpu", str(tmp_path / "missing"))
    assert fast_bf16("cuda", str(plain))
