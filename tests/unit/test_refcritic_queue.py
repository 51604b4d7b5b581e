"""The refcritic queue path's pure parts: chunking, reassembly, job and answer codecs."""

from __future__ import annotations

import pytest

from rlfleet.common.errors import ErrorCode, FailedPrecondition, Internal, InvalidArgument
from rlfleet.common.queue.workqueue import Result
from rlfleet.refcritic.queue_service import (
    chunk_batch,
    decode_job,
    encode_job,
    encode_rows,
    reassemble,
    rows_of,
)


def batch(n: int):
    prompts = [[i, i + 1] for i in range(n)]
    responses = [[i] * (1 + i % 3) for i in range(n)]
    return prompts, responses


@pytest.mark.parametrize(("n", "size", "sizes"), [(10, 4, [4, 4, 2]), (4, 4, [4]), (3, 0, [1] * 3)])
def test_chunks_are_consecutive_and_bounded(n, size, sizes):
    prompts, responses = batch(n)
    chunks = chunk_batch(prompts, responses, size)
    assert [len(c.prompts) for c in chunks] == sizes
    assert [p for c in chunks for p in c.prompts] == prompts
    assert [r for c in chunks for r in c.responses] == responses
    assert [c.start for c in chunks] == [sum(sizes[:i]) for i in range(len(sizes))]


def test_reassemble_restores_input_order():
    prompts, responses = batch(7)
    chunks = chunk_batch(prompts, responses, 3)
    answers = [[[float(c.start + i)] * len(r) for i, r in enumerate(c.responses)] for c in chunks]
    rows = reassemble(chunks, answers)
    assert [row[0] for row in rows] == [float(i) for i in range(7)]
    assert [len(row) for row in rows] == [len(r) for r in responses]


def test_reassemble_rejects_a_short_answer():
    prompts, responses = batch(4)
    chunks = chunk_batch(prompts, responses, 2)
    with pytest.raises(RuntimeError, match="1 rows for 2"):
        reassemble(chunks, [[[0.0], [0.0]], [[0.0]]])


def test_mismatched_batch_is_invalid():
    with pytest.raises(InvalidArgument):
        chunk_batch([[1]], [], 2)


def test_job_round_trip_and_bad_payloads():
    assert decode_job(encode_job("values", [[1, 2]], [[3]])) == ("values", [[1, 2]], [[3]])
    for payload in (
        b"not json",
        b'{"kind": "ref"}',
        b'{"kind": "x", "prompts": [], "responses": []}',
    ):
        with pytest.raises(InvalidArgument):
            decode_job(payload)


def test_answers_map_back_to_rows_or_the_workers_error():
    assert rows_of(Result("q", encode_rows([[0.5, -1.0]]))) == [[0.5, -1.0]]
    with pytest.raises(InvalidArgument, match="token id 99"):
        rows_of(Result("q", b"", ErrorCode.INVALID_ARGUMENT, "token id 99 outside"))
    with pytest.raises(FailedPrecondition):
        rows_of(Result("q", b"", ErrorCode.FAILED_PRECONDITION, "no critic"))
    with pytest.raises(Internal, match="dead-lettered"):  # a RuntimeError, as before
        rows_of(Result("q", b"", ErrorCode.INTERNAL, "dead-lettered after too many deliveries"))
