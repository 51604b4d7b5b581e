"""Proto <-> plain objects for the Rollout service, used by the replica's server and its client.

Protobuf types stop here: the replica core and its callers pass the dataclasses of
``rlfleet.rollout.types`` and ``rlfleet.model.weights``. Proto3 cannot tell an unset scalar
from 0, so (as ``types`` documents): a request without ``sampling`` gets the dataclass
defaults; a present ``sampling`` is taken as sent, so ``n=0`` or ``max_tokens=0`` fail
validation instead of silently becoming 1 and 16. Only the zeros the proto documents keep
their "unset" meaning: ``top_p`` 0 is 1, ``top_k`` <= 0 is off. Temperature 0 is greedy. The
router uses these same converters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, fields

from rlfleet.model.weights import TensorEntry, WeightHeader
from rlfleet.model.weights_broadcast import BroadcastGroup
from rlfleet.model.weights_relay import RelayResult, RelayTarget
from rlfleet.proto import common_pb2, rollout_pb2
from rlfleet.rollout.types import (
    Completion,
    GenerateRequest,
    GenerateResult,
    ReplicaState,
    ReplicaStatus,
    SamplingParams,
    ScoredSequence,
    ScoreRequest,
    TokenScores,
    UpdateOutcome,
)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        n=msg.n,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=max(0, msg.top_k),
        max_tokens=msg.max_tokens,
        stop=list(msg.stop),
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs,
    )


def sampling_to_proto(sampling: SamplingParams) -> common_pb2.SamplingParams:
    values = {f.name: getattr(sampling, f.name) for f in fields(sampling)}
    if values["seed"] is None:
        del values["seed"]
    return common_pb2.SamplingParams(**values)


def request_from_proto(msg: rollout_pb2.GenerateRequest) -> GenerateRequest:
    which = msg.WhichOneof("prompt")
    sent = msg.HasField("sampling")
    return GenerateRequest(
        request_id=msg.request_id,
        sampling=sampling_from_proto(msg.sampling) if sent else SamplingParams(),
        prompt_token_ids=list(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        prompt_text=msg.prompt_text if which == "prompt_text" else None,
        session_id=msg.session_id,
        min_weight_version=msg.min_weight_version,
        timeout_s=msg.timeout_s,
    )


def request_to_proto(request: GenerateRequest) -> rollout_pb2.GenerateRequest:
    msg = rollout_pb2.GenerateRequest(
        request_id=request.request_id,
        session_id=request.session_id,
        sampling=sampling_to_proto(request.sampling),
        min_weight_version=request.min_weight_version,
        timeout_s=request.timeout_s,
    )
    if request.prompt_token_ids:
        msg.prompt_token_ids.ids.extend(request.prompt_token_ids)
    elif request.prompt_text is not None:
        msg.prompt_text = request.prompt_text
    return msg


def result_to_proto(result: GenerateResult) -> rollout_pb2.GenerateResponse:
    # Fields by name rather than asdict(), which would deep-copy every token list first.
    completions = [
        common_pb2.Completion(
            token_ids=c.token_ids,
            logprobs=c.logprobs,
            text=c.text,
            finish_reason=c.finish_reason,
            weight_versions=c.weight_versions,
        )
        for c in result.completions
    ]
    return rollout_pb2.GenerateResponse(
        request_id=result.request_id,
        completions=completions,
        weight_version=result.weight_version,
        replica_id=result.replica_id,
        prompt_token_ids=result.prompt_token_ids,
    )


def result_from_proto(msg: rollout_pb2.GenerateResponse) -> GenerateResult:
    completions = [
        Completion(
            list(c.token_ids), list(c.logprobs), c.text, c.finish_reason, list(c.weight_versions)
        )
        for c in msg.completions
    ]
    return GenerateResult(
        msg.request_id, completions, msg.weight_version, msg.replica_id, list(msg.prompt_token_ids)
    )


def batch_from_proto(msg: rollout_pb2.GenerateBatchRequest) -> list[GenerateRequest]:
    return [request_from_proto(request) for request in msg.requests]


def batch_to_proto(requests: Sequence[GenerateRequest]) -> rollout_pb2.GenerateBatchRequest:
    return rollout_pb2.GenerateBatchRequest(requests=[request_to_proto(r) for r in requests])


def batch_results_to_proto(results: Sequence[GenerateResult]) -> rollout_pb2.GenerateBatchResponse:
    return rollout_pb2.GenerateBatchResponse(responses=[result_to_proto(r) for r in results])


def batch_results_from_proto(msg: rollout_pb2.GenerateBatchResponse) -> list[GenerateResult]:
    return [result_from_proto(response) for response in msg.responses]


def header_from_proto(msg: rollout_pb2.WeightUpdateHeader) -> WeightHeader:
    tensors = [
        TensorEntry(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in msg.tensors
    ]
    checksum = msg.checksum or (f"sha256:{msg.sha256}" if msg.sha256 else "")
    return WeightHeader(
        msg.version,
        tensors,
        msg.total_bytes,
        checksum,
        msg.flush_cache,
        msg.force,
        msg.shared_memory,
        relay=tuple(_relay_from_proto(t) for t in msg.relay),
        broadcast=_broadcast_from_proto(msg.broadcast) if msg.HasField("broadcast") else None,
    )


def _broadcast_from_proto(msg: rollout_pb2.BroadcastGroup) -> BroadcastGroup:
    return BroadcastGroup(**{f.name: getattr(msg, f.name) for f in fields(BroadcastGroup)})


def _relay_from_proto(msg: rollout_pb2.RelayTarget) -> RelayTarget:
    return RelayTarget(msg.replica_id, msg.address, tuple(map(_relay_from_proto, msg.children)))


def _relay_to_proto(target: RelayTarget) -> rollout_pb2.RelayTarget:
    children = [_relay_to_proto(c) for c in target.children]
    return rollout_pb2.RelayTarget(
        replica_id=target.replica_id, address=target.address, children=children
    )


def header_to_proto(header: WeightHeader) -> rollout_pb2.WeightUpdateHeader:
    tensors = [
        common_pb2.TensorSpec(
            name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes
        )
        for t in header.tensors
    ]
    return rollout_pb2.WeightUpdateHeader(
        version=header.version,
        tensors=tensors,
        total_bytes=header.total_bytes,
        checksum=header.checksum,
        flush_cache=header.flush_cache,
        force=header.force,
        shared_memory=header.shared_memory,
        relay=[_relay_to_proto(t) for t in header.relay],
        broadcast=rollout_pb2.BroadcastGroup(**asdict(header.broadcast))
        if header.broadcast
        else None,
    )


def status_to_proto(status: ReplicaStatus) -> rollout_pb2.ReplicaStatus:
    return rollout_pb2.ReplicaStatus(**{**asdict(status), "state": str(status.state)})


def status_from_proto(msg: rollout_pb2.ReplicaStatus) -> ReplicaStatus:
    values = {f.name: getattr(msg, f.name) for f in fields(ReplicaStatus)}
    return ReplicaStatus(**{**values, "state": ReplicaState.parse(msg.state)})


def outcome_to_proto(outcome: UpdateOutcome) -> rollout_pb2.UpdateWeightsResponse:
    return rollout_pb2.UpdateWeightsResponse(**asdict(outcome))


def outcome_from_proto(msg: rollout_pb2.UpdateWeightsResponse) -> UpdateOutcome:
    relayed = [
        RelayResult(r.replica_id, r.ok, r.version, r.error, r.pause_seconds) for r in msg.relayed
    ]
    return UpdateOutcome(
        msg.version,
        msg.load_seconds,
        msg.cache_flushed,
        msg.pause_seconds,
        msg.prepare_seconds,
        relayed,
    )


def score_request_to_proto(request: ScoreRequest) -> rollout_pb2.ScoreTokensRequest:
    sequences = [
        rollout_pb2.ScoredSequence(
            prompt_token_ids=s.prompt_token_ids, target_token_ids=s.target_token_ids
        )
        for s in request.sequences
    ]
    return rollout_pb2.ScoreTokensRequest(
        sequences=sequences, min_weight_version=request.min_weight_version
    )


def score_request_from_proto(msg: rollout_pb2.ScoreTokensRequest) -> ScoreRequest:
    sequences = [
        ScoredSequence(list(s.prompt_token_ids), list(s.target_token_ids)) for s in msg.sequences
    ]
    return ScoreRequest(sequences, msg.min_weight_version)


def scores_to_proto(scores: TokenScores) -> rollout_pb2.ScoreTokensResponse:
    rows = [rollout_pb2.TokenLogprobs(values=row) for row in scores.logprobs]
    return rollout_pb2.ScoreTokensResponse(
        logprobs=rows, weight_version=scores.weight_version, replica_id=scores.replica_id
    )


def scores_from_proto(msg: rollout_pb2.ScoreTokensResponse) -> TokenScores:
    rows = [list(row.values) for row in msg.logprobs]
    return TokenScores(rows, msg.weight_version, msg.replica_id)
