"""The weight codec: round trips, integrity checks, and the copies it promises not to make."""

import pytest
import torch

from rlfleet.common.errors import InvalidArgument
from rlfleet.model import weights, weights_checksum, weights_magnitude
from rlfleet.proto import rollout_pb2
from rlfleet.rollout.client import PreparedUpdate
from rlfleet.rollout.server import parse_update_message
from rlfleet.trainer.weight_sync import push_metrics
from rlfleet.trainer.weight_transport import PushResult


def sample_state() -> dict:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(3, 4),
        "b.bias": torch.arange(5, dtype=torch.int64),
        "c.half": torch.randn(2, 2).to(torch.bfloat16),
    }


def received(header: weights.WeightHeader, payload, chunk_bytes: int = 10) -> memoryview:
    """What a replica ends up with: the chunks written into one ``PayloadBuffer``."""
    buffer = weights.PayloadBuffer(header.total_bytes)
    for chunk in weights.iter_chunks(payload, chunk_bytes):
        buffer.write(chunk)
    return buffer.payload()


def test_round_trip_preserves_names_dtypes_shapes_values():
    state = sample_state()
    header, payload = weights.encode(state, version=7)
    assert len(list(weights.iter_chunks(payload, chunk_bytes=10))) > 1
    decoded = weights.decode(header, received(header, payload))
    assert header.version == 7
    assert list(decoded) == list(state)
    for name, tensor in state.items():
        assert decoded[name].dtype == tensor.dtype
        assert torch.equal(decoded[name], tensor)


def test_decoded_tensors_are_views_of_the_receive_buffer():
    header, payload = weights.encode(sample_state(), version=1)
    buffer = received(header, payload)
    decoded = weights.decode(header, buffer)
    buffer[0:4] = torch.tensor([42.0]).numpy().tobytes()  # the first float of a.weight
    assert decoded["a.weight"][0, 0].item() == 42.0


def test_chunks_are_slices_of_the_one_payload_not_copies():
    header, payload = weights.encode(sample_state(), version=1)
    chunks = list(weights.iter_chunks(payload, chunk_bytes=16))
    assert all(isinstance(chunk, memoryview) and chunk.obj is payload.obj for chunk in chunks)
    assert b"".join(chunks) == bytes(payload)


def test_prepared_messages_parse_as_the_proto_the_replica_expects():
    header, payload = weights.encode(sample_state(), version=3, force=True)
    update = PreparedUpdate.of(header, payload, chunk_bytes=16)
    first, *data = [rollout_pb2.WeightChunk.FromString(m) for m in update.messages]
    assert (first.header.version, first.header.force, first.header.checksum) == (
        3,
        True,
        header.checksum,
    )
    assert b"".join(m.data for m in data) == bytes(payload)
    big = memoryview(bytes(range(256)) * 1024)  # a multi-byte varint length
    big_update = PreparedUpdate.of(header, big, chunk_bytes=200_000)
    assert rollout_pb2.WeightChunk.FromString(big_update.messages[1]).data == bytes(big[:200_000])


def test_checksum_is_computed_once_by_the_sender_with_a_fast_algorithm():
    header, payload = weights.encode(sample_state(), version=1)
    algorithm = header.checksum.partition(":")[0]
    assert algorithm in ("xxh3_128", "crc32")
    weights_checksum.verify_checksum(header.checksum, payload)
    weights_checksum.verify_checksum(
        weights_checksum.checksum(payload, "sha256"), payload
    )  # older senders


def test_checksum_mismatch_is_rejected():
    header, payload = weights.encode(sample_state(), version=1)
    corrupted = bytearray(payload)
    corrupted[5] ^= 0xFF
    with pytest.raises(InvalidArgument, match="checksum"):
        weights.decode(header, bytes(corrupted))


def test_unknown_checksum_algorithm_is_rejected():
    header, payload = weights.encode(sample_state(), version=1)
    header.checksum = "md5:abc"
    with pytest.raises(InvalidArgument, match="unsupported checksum"):
        weights.decode(header, payload)


def test_truncated_payload_is_rejected():
    header, payload = weights.encode(sample_state(), version=1)
    with pytest.raises(InvalidArgument, match="truncated"):
        weights.decode(header, payload[:-4])
    buffer = weights.PayloadBuffer(header.total_bytes)
    buffer.write(payload[:-4])
    with pytest.raises(InvalidArgument, match="truncated"):
        buffer.payload()


def test_a_chunk_past_the_announced_size_is_refused_without_growing_the_buffer():
    header, payload = weights.encode(sample_state(), version=1)
    buffer = weights.PayloadBuffer(header.total_bytes)
    buffer.write(payload)
    with pytest.raises(InvalidArgument, match="exceeds"):
        buffer.write(b"extra")
    assert buffer.received == header.total_bytes


def test_header_sizes_must_follow_from_dtype_and_shape():
    header, _ = weights.encode(sample_state(), version=1)
    first = header.tensors[0]
    header.tensors[0] = weights.TensorEntry(first.name, first.dtype, first.shape, 0, 10**12)
    header.total_bytes += 10**12 - first.nbytes
    with pytest.raises(InvalidArgument, match="bad offset/size"):
        weights.validate_header(header)  # refused before a byte of payload is buffered


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_named(dtype: torch.dtype, bad: float):
    state = {"ok": torch.randn(100), "w": torch.randn(1000).to(dtype)}
    weights_magnitude.check_finite(state)
    state["w"][777] = bad
    with pytest.raises(InvalidArgument, match="'w' holds NaN or inf"):
        weights_magnitude.check_finite(state)


def test_misaligned_tensors_still_decode():
    state = {"odd": torch.ones(3, dtype=torch.bfloat16), "f": torch.arange(4.0)}
    header, payload = weights.encode(state, version=1)
    assert header.tensors[1].offset % 4 != 0
    assert torch.equal(weights.decode(header, received(header, payload))["f"], state["f"])


def test_size_bound_allows_float32_weights_of_the_model_and_not_much_more():
    numel = 1_000_000
    assert weights.max_bytes_for(numel) >= numel * 4
    assert weights.max_bytes_for(numel) < numel * 4 * 1.05 + 2**21


def test_push_metrics_keep_the_old_names_and_add_per_replica_ones():
    results = [PushResult("r0", True, 2, 0.5, 2**20), PushResult("r1", False, 1, 1.5, 0, "x")]
    metrics = push_metrics(results)
    assert (metrics["weight_sync/replicas"], metrics["weight_sync/failed"]) == (1.0, 1.0)
    assert metrics["weight_sync/mbytes"] == 1.0
    assert metrics["weight_sync/r0/seconds"] == 0.5 and metrics["weight_sync/r1/mbytes"] == 0.0
    assert metrics["weight_sync/push_s_max"] == 0.5


def test_the_replica_reads_data_chunks_in_place_and_parses_anything_else():
    header, payload = weights.encode(sample_state(), version=2)
    update = PreparedUpdate.of(header, payload, chunk_bytes=16)
    first, *data = [parse_update_message(m) for m in update.messages]
    assert isinstance(first, rollout_pb2.WeightChunk) and first.header.version == 2
    assert all(isinstance(d, memoryview) for d in data)
    assert b"".join(data) == bytes(payload)
    odd = rollout_pb2.WeightChunk(data=b"abc").SerializeToString() + b"\x12\x01z"  # two fields
    assert parse_update_message(odd).data == b"z"  # protobuf's rule: the last one wins
