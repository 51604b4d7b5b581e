import pytest
import torch

from rlfleet.common import weights
from rlfleet.common.errors import InvalidArgument


def sample_state() -> dict:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(3, 4),
        "b.bias": torch.arange(5, dtype=torch.int64),
        "c.half": torch.randn(2, 2).to(torch.bfloat16),
    }


def test_round_trip_preserves_names_dtypes_shapes_values():
    state = sample_state()
    header, payload = weights.encode(state, version=7)
    chunks = list(weights.iter_chunks(payload, chunk_bytes=10))
    assert len(chunks) > 1
    decoded = weights.decode(header, weights.join_chunks(chunks, header.total_bytes))
    assert header.version == 7
    assert list(decoded) == list(state)
    for name, tensor in state.items():
        assert decoded[name].dtype == tensor.dtype
        assert torch.equal(decoded[name], tensor)


def test_checksum_mismatch_is_rejected():
    header, payload = weights.encode(sample_state(), version=1)
    corrupted = bytearray(payload)
    corrupted[5] ^= 0xFF
    with pytest.raises(InvalidArgument, match="checksum"):
        weights.decode(header, bytes(corrupted))


def test_truncated_payload_is_rejected():
    header, payload = weights.encode(sample_state(), version=1)
    with pytest.raises(InvalidArgument, match="truncated"):
        weights.decode(header, payload[:-4])


def test_oversized_stream_is_rejected_while_joining():
    header, payload = weights.encode(sample_state(), version=1)
    with pytest.raises(InvalidArgument, match="exceeds"):
        weights.join_chunks([payload, b"extra"], header.total_bytes)


def test_bad_version_and_unknown_dtype_are_rejected():
    header, payload = weights.encode(sample_state(), version=1)
    header.version = 0
    with pytest.raises(InvalidArgument, match="version"):
        weights.decode(header, payload)
    header.version = 1
    first = header.tensors[0]
    header.tensors[0] = weights.TensorEntry(first.name, "complex512", first.shape, 0, first.nbytes)
    with pytest.raises(InvalidArgument, match="dtype"):
        weights.decode(header, payload)
