"""Proto <-> plain objects for the Reward service, used by its server and by its client.

Why a module of its own: the client needs the same conversions as the server, and must not
import the server (nor, through it, the service, its Redis queue and its scorers).

``Struct`` holds only doubles, so integral numbers in ``extra_info`` come back as ints
(``{"index": 3}`` stays 3, not 3.0): user functions written for verl index lists with them.
A ground truth that is not a string travels as a ``Value`` (``ground_truth_value``) and comes
back as the same JSON value (a dict stays a dict, ``12`` stays an int).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from rlfleet.common import errors
from rlfleet.common.proto_struct import struct_to_dict, value_to_python
from rlfleet.proto import reward_pb2
from rlfleet.reward.types import ScoreRequest, ScoreResult, ScorerInfo


def request_from_proto(msg: reward_pb2.ScoreRequest) -> ScoreRequest:
    return ScoreRequest(
        id=msg.id,
        data_source=msg.data_source,
        solution_str=msg.solution_str,
        ground_truth=_ground_truth_from_proto(msg),
        extra_info=struct_to_dict(msg.extra_info),
        scorer=msg.scorer if msg.HasField("scorer") else None,
        prompt=msg.prompt,
    )


def request_to_proto(request: ScoreRequest) -> reward_pb2.ScoreRequest:
    msg = reward_pb2.ScoreRequest(
        id=request.id,
        data_source=request.data_source,
        solution_str=request.solution_str,
        prompt=request.prompt,
    )
    _ground_truth_to_proto(request, msg)
    if request.extra_info:
        try:
            msg.extra_info.update(request.extra_info)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"extra_info of {request.id!r}: {exc}") from exc
    if request.scorer:
        msg.scorer = request.scorer
    return msg


def result_to_proto(result: ScoreResult) -> reward_pb2.ScoreResult:
    return reward_pb2.ScoreResult(
        id=result.id, score=result.score, metrics=result.metrics, error=result.error
    )


def result_from_proto(msg: reward_pb2.ScoreResult) -> ScoreResult:
    return ScoreResult(id=msg.id, score=msg.score, metrics=dict(msg.metrics), error=msg.error)


def scorer_info_to_proto(info: ScorerInfo) -> reward_pb2.ScorerInfo:
    return reward_pb2.ScorerInfo(
        name=info.name,
        kind=info.kind,
        data_sources=info.data_sources,
        description=info.description,
    )


def scorer_info_from_proto(msg: reward_pb2.ScorerInfo) -> ScorerInfo:
    return ScorerInfo(msg.name, msg.kind, list(msg.data_sources), msg.description)


def _ground_truth_from_proto(msg: reward_pb2.ScoreRequest) -> Any:
    if not msg.HasField("ground_truth_value"):
        return msg.ground_truth
    return value_to_python(msg.ground_truth_value)


def _ground_truth_to_proto(request: ScoreRequest, msg: reward_pb2.ScoreRequest) -> None:
    if isinstance(request.ground_truth, str):
        msg.ground_truth = request.ground_truth
        return
    try:
        json_format.ParseDict(request.ground_truth, msg.ground_truth_value)
    except (TypeError, ValueError, json_format.ParseError) as exc:
        raise errors.InvalidArgument(f"ground_truth of {request.id!r}: {exc}") from exc
