"""Proto <-> plain lists for the RefCritic service, used by its server and by its client.

Why plain lists: the trainer keeps per-sequence Python lists (token ids in, one float per
response token out) and should not see protobuf types; neither should the models.
"""

from __future__ import annotations

from rlfleet.proto import common_pb2, refcritic_pb2


def rows_to_proto(rows: list[list[float]]) -> common_pb2.FloatRows:
    return common_pb2.FloatRows(rows=[common_pb2.FloatRow(values=row) for row in rows])


def rows_from_proto(message: common_pb2.FloatRows) -> list[list[float]]:
    return [list(row.values) for row in message.rows]


def sequences_to_proto(
    prompts: list[list[int]], responses: list[list[int]]
) -> refcritic_pb2.SequenceBatch:
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    sequences = [
        refcritic_pb2.Sequence(prompt_token_ids=p, response_token_ids=r)
        for p, r in zip(prompts, responses, strict=True)
    ]
    return refcritic_pb2.SequenceBatch(sequences=sequences)


def sequences_from_proto(
    batch: refcritic_pb2.SequenceBatch,
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, responses) as plain lists of token ids."""
    prompts = [list(s.prompt_token_ids) for s in batch.sequences]
    return prompts, [list(s.response_token_ids) for s in batch.sequences]
