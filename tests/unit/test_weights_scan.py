"""The one pass over a push's bytes: the sender copies and hashes piece by piece, a replica
hashes and reads magnitudes piece by piece. Same digests as the one-shot checksums, every
corrupted byte still refused, magnitudes exact, and the refusals in their old order."""

import math

import pytest
import torch

from rlfleet.common.errors import InvalidArgument
from rlfleet.model import weights, weights_checksum, weights_magnitude, weights_shm
from rlfleet.rollout.weight_updates import verified

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ALGORITHMS = ["xxh3_128", "crc32", "sha256"]


def big_state() -> dict:
    """Tensors spanning several scan pieces, tiny ones, an odd-sized one (misaligned offsets
    after it) and a non-floating one."""
    torch.manual_seed(1)
    piece = weights.SCAN_CHUNK_BYTES
    return {
        "embed": torch.randn(3 * piece // 2 + 5).to(torch.bfloat16),  # 1.5 pieces and a bit
        "odd": torch.randn(3).to(torch.bfloat16),
        "norm": -torch.rand(7, dtype=torch.float32) - 0.5,  # negative only, misaligned
        "ids": torch.arange(11, dtype=torch.int64),
        "proj": torch.randn(piece // 4 + 3, dtype=torch.float32) * 40.0,
        "wide": torch.randn(9, dtype=torch.float64),
        "half": torch.randn(33).to(torch.float16),
    }


def expected_largest(tensor: torch.Tensor) -> float:
    return tensor.double().abs().max().item() if tensor.numel() else 0.0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_streaming_hasher_gives_the_one_shot_digest_whatever_the_split(algorithm: str):
    data = bytes(range(256)) * 999
    one_shot = weights_checksum.checksum(data, algorithm)
    for step in (1, 7, 4096, len(data)):
        hasher = weights_checksum.Hasher(algorithm)
        for start in range(0, len(data), step):
            hasher.update(memoryview(data)[start : start + step])
        assert f"{algorithm}:{hasher.hexdigest()}" == one_shot


def test_unknown_algorithm_is_refused_by_the_hasher():
    with pytest.raises(InvalidArgument, match="unsupported checksum"):
        weights_checksum.Hasher("md5")


@pytest.mark.parametrize("algorithm", ["xxh3_128", "crc32"])
def test_encode_checksums_the_payload_it_wrote(monkeypatch, algorithm: str):
    monkeypatch.setattr(weights, "default_algorithm", lambda: algorithm)
    state = big_state()
    header, payload = weights.encode(state, version=1)
    assert header.checksum == weights_checksum.checksum(payload, algorithm)
    decoded, _ = weights.decode_measured(header, payload)
    assert all(torch.equal(decoded[name], tensor) for name, tensor in state.items())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_corrupted_byte_anywhere_is_refused(algorithm: str):
    header, payload = weights.encode(big_state(), version=1)
    header.checksum = weights_checksum.checksum(payload, algorithm)  # as a sender of that algorithm
    weights.decode_measured(header, payload)  # intact: accepted
    piece = weights.SCAN_CHUNK_BYTES
    for index in (0, piece - 1, piece, piece + 1, header.tensors[2].offset, len(payload) - 1):
        corrupted = bytearray(payload)
        corrupted[index] ^= 0x01  # one bit
        with pytest.raises(InvalidArgument, match=f"checksum mismatch \\({algorithm}\\)"):
            weights.decode_measured(header, corrupted)
        with pytest.raises(InvalidArgument, match="checksum"):
            verified(header, corrupted, max_weight_abs=1e5)


def test_a_corrupted_byte_in_shared_memory_is_refused_by_the_replica():
    holder: list[weights_shm.SharedPayload] = []

    def allocate(nbytes: int) -> torch.Tensor:
        holder.append(weights_shm.SharedPayload(nbytes))
        return holder[0].tensor()

    header, _ = weights.encode(big_state(), 2, allocate=allocate)
    try:
        verified(header, weights_shm.open_shared(holder[0].name, header.total_bytes), 1e5)
        holder[0].tensor()[weights.SCAN_CHUNK_BYTES + 3] ^= 0x10  # the trainer's file damaged
        view = weights_shm.open_shared(holder[0].name, header.total_bytes)
        with pytest.raises(InvalidArgument, match="checksum mismatch"):
            verified(header, view, 1e5)
    finally:
        holder[0].close()


def test_measured_magnitudes_are_each_floating_tensors_largest_absolute_value():
    state = big_state()
    header, payload = weights.encode(state, version=1)
    _, largest = weights.decode_measured(header, payload)
    assert set(largest) == {name for name, t in state.items() if t.dtype.is_floating_point}
    for name, value in largest.items():
        assert value == expected_largest(state[name]), name
        assert value == weights_magnitude.largest_magnitude(state[name])


@pytest.mark.parametrize("dtype", FLOATS)
def test_largest_magnitude_reads_signs_zeros_and_specials_from_the_bits(dtype: torch.dtype):
    cases = [
        torch.tensor([0.5, -3.0, 2.0]),  # the largest is negative
        torch.tensor([-0.5, 3.0, -2.0]),  # positive
        torch.tensor([-0.25, -0.125]),  # negative only
        torch.tensor([0.0, -0.0]),
        torch.tensor([1e-40, -1e-41]),  # subnormal in float32 (zero in bf16/fp16)
        torch.tensor([]),
    ]
    for values in cases:
        tensor = values.to(dtype)
        assert weights_magnitude.largest_magnitude(tensor) == expected_largest(tensor), values
    assert weights_magnitude.largest_magnitude(torch.tensor([1.0, -math.inf]).to(dtype)) == math.inf
    assert math.isnan(
        weights_magnitude.largest_magnitude(torch.tensor([math.inf, math.nan]).to(dtype))
    )
    assert math.isnan(weights_magnitude.largest_magnitude(torch.tensor([-math.nan, 1.0]).to(dtype)))


def test_other_dtypes_take_aminmax_and_non_floating_ones_count_zero():
    assert weights_magnitude.largest_magnitude(torch.tensor([-7, 3])) == 0.0
    eight = torch.tensor([0.5, -4.0]).to(torch.float8_e4m3fn)
    assert weights_magnitude.largest_magnitude(eight) == 4.0
    assert (
        weights_magnitude.largest_magnitude(torch.tensor([-2.0, 9.0, 1.0, 9.0])[::2]) == 2.0
    )  # strided


@pytest.mark.parametrize("dtype", FLOATS)
def test_verified_refuses_non_finite_before_absurd_and_names_the_tensor(dtype: torch.dtype):
    state = big_state()
    state["half"] = torch.randn(33).to(dtype)
    state["half"][20] = 1e30 if dtype != torch.float16 else 65000.0
    header, payload = weights.encode(state, version=1)
    verified(header, bytearray(payload))  # no bound asked for: accepted
    with pytest.raises(InvalidArgument, match=r"'half'.*> rollout.max_weight_abs"):
        verified(header, bytearray(payload), max_weight_abs=1e3)
    state["embed"][5] = math.nan  # an earlier tensor, and worse: named first
    header, payload = weights.encode(state, version=1)
    with pytest.raises(InvalidArgument, match="'embed' holds NaN or inf"):
        verified(header, bytearray(payload), max_weight_abs=1e3)
