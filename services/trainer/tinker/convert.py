"""The SDK's request and response bodies <-> the API's plain records (``types``).

``forward_backward`` arrives as protobuf (``rlfleet.proto.tinker_wire_pb2``, the SDK's field
numbers); its answer and ``sample``'s go back as protobuf, as the SDK asks; the rest is JSON.
A field this server does not support is refused by name (``InvalidArgument``), not dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlfleet.common.errors import InvalidArgument
from rlfleet.proto import tinker_wire_pb2 as pb
from rlfleet.trainer.tinker.checks import stop_strings
from rlfleet.trainer.tinker.types import (
    AdamStep,
    Datum,
    ForwardResult,
    LoraSpec,
    SampledSequence,
    SampleSpec,
)

NUMPY = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
INT_KEYS = frozenset({"target_tokens"})
UNSUPPORTED_SAMPLE = {
    "prompt_logprobs": "include_prompt_logprobs",
    "topk_prompt_logprobs": "topk_prompt_logprobs",
    "topk_sample_logprobs": "topk_sample_logprobs",
    "target_prompt_logprobs": "target_prompt_logprobs",
    "prompt_alt_tokens_k": "prompt_alt_tokens_k",
    "prompt_logprobs_last_n": "prompt_logprobs_last_n",
    "record_stability_info": "record_stability_info",
}
"""``SampleRequest`` fields (a truthy value is refused) and the SDK argument each comes from."""


@dataclass(frozen=True)
class ForwardCall:
    model_id: str
    seq_id: int
    data: list[Datum]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool


def forward_call(body: bytes, forward_only: bool = False) -> ForwardCall:
    """A protobuf ``ForwardBackwardRequest`` body."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:
        raise InvalidArgument(
            f"forward_backward body is not a ForwardBackwardRequest: {exc}"
        ) from exc
    data = [_datum(i, d) for i, d in enumerate(msg.data)]
    return ForwardCall(
        msg.model_id,
        msg.seq_id,
        data,
        msg.loss_fn,
        _loss_config(msg),
        msg.forward_only or forward_only,
    )


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float]:
    if msg.loss_fn_config_v2:
        texts = [k for k, v in msg.loss_fn_config_v2.items() if v.WhichOneof("value") == "text"]
        if texts:
            raise InvalidArgument(f"loss_fn_config {texts}: text values are not supported")
        return {k: v.number for k, v in msg.loss_fn_config_v2.items()}
    return dict(msg.loss_fn_config)


def _datum(i: int, d: pb.Datum) -> Datum:
    if d.model_input_spans or d.loss_fn_input_spans:
        raise InvalidArgument(f"datum {i}: provenance spans (stable_reinforce) are not supported")
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidArgument(
                f"datum {i}: {kind or 'empty'} chunks are not supported (text tokens only)"
            )
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
    inputs = {key: _array(f"datum {i}: {key}", key, t) for key, t in d.loss_fn_inputs.items()}
    return Datum(tokens, inputs)


def _array(what: str, key: str, t: pb.Tensor) -> np.ndarray:
    """A ``Tensor`` message as a numpy array of the key's type (CSR densified with 0)."""
    if t.dtype not in NUMPY:
        raise InvalidArgument(f"{what}: dtype {pb.DType.Name(t.dtype)} is not supported")
    dtype: np.dtype = np.dtype(NUMPY[t.dtype]).newbyteorder("<")
    shape = list(t.shape)
    try:
        if t.WhichOneof("encoding") == "sparse_csr":
            values = _csr(t.sparse_csr, dtype, shape)
        else:
            values = np.frombuffer(t.dense, dtype=dtype).reshape(shape or [-1])
    except ValueError as exc:
        raise InvalidArgument(f"{what}: data does not fit shape {shape}: {exc}") from exc
    return values.astype(np.int64 if key in INT_KEYS else np.float32)


def _csr(csr: pb.SparseCsr, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    if len(shape) != 2:
        raise ValueError("a sparse tensor must be 2-D")
    crow = np.frombuffer(csr.crow_indices, dtype="<i8")
    col = np.frombuffer(csr.col_indices, dtype="<i8")
    values = np.frombuffer(csr.values, dtype=dtype)
    dense = np.zeros(shape, dtype=dtype)
    for row in range(shape[0]):
        start, end = int(crow[row]), int(crow[row + 1])
        dense[row, col[start:end]] = values[start:end]
    return dense


def forward_output(result: ForwardResult) -> bytes:
    """``ForwardBackwardOutput`` protobuf: one record, fields ``logprobs`` and
    ``elementwise_loss`` per datum."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(result.logprobs))
    for name, arrays in (("logprobs", result.logprobs), ("elementwise_loss", result.losses)):
        record.fields[name].CopyFrom(_batched(arrays))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    out.metrics.update(result.metrics)
    return out.SerializeToString()


def _batched(arrays: Sequence[np.ndarray]) -> pb.BatchedTensor:
    parts = [np.ascontiguousarray(a, dtype="<f4").tobytes() for a in arrays]
    offsets = np.cumsum([0, *map(len, parts)]).astype("<i8")
    return pb.BatchedTensor(data=b"".join(parts), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)


def sample_response(sequences: Sequence[SampledSequence]) -> bytes:
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_LENGTH if s.stop_reason == "length" else pb.STOP_REASON_STOP,
            tokens=np.asarray(s.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(),
        )
    return out.SerializeToString()


# ---- JSON ------------------------------------------------------------------------------


def tokens_of(model_input: Mapping[str, Any], what: str = "prompt") -> list[int]:
    """A ``ModelInput`` JSON (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``)."""
    tokens: list[int] = []
    for chunk in model_input.get("chunks", []):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise InvalidArgument(f"{what}: {kind} chunks are not supported (text tokens only)")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tokens


def lora_spec(body: Mapping[str, Any]) -> LoraSpec:
    lora = body.get("lora_config")
    if lora is None:
        raise InvalidArgument(
            "create_model without lora_config (full fine-tuning) is not "
            "supported: this server trains LoRA adapters"
        )
    optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
    if optimizer != "adamw":
        raise InvalidArgument(f"optimizer {optimizer!r} is not supported (adamw only)")
    return LoraSpec(
        int(lora["rank"]),
        lora.get("seed"),
        bool(lora.get("train_mlp", True)),
        bool(lora.get("train_attn", True)),
        bool(lora.get("train_unembed", True)),
    )


def adam_step(body: Mapping[str, Any]) -> AdamStep:
    params = body.get("adam_params") or body.get("optim_params")
    if params is None:
        kind = (body.get("optimizer_params") or {}).get("type", "unknown")
        raise InvalidArgument(
            f"optimizer parameters of type {kind!r} are not supported (AdamParams only)"
        )
    fields = AdamStep.__dataclass_fields__
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise InvalidArgument(f"adam_params {unknown} are not supported")
    return AdamStep(**{k: float(v) for k, v in params.items()})


def sample_spec(body: Mapping[str, Any], eos_ids: set[int]) -> SampleSpec:
    for field, argument in UNSUPPORTED_SAMPLE.items():
        if body.get(field):
            raise InvalidArgument(f"sample({argument}=...) is not supported by this server")
    params = body.get("sampling_params") or {}
    return SampleSpec(
        prompt=tokens_of(body.get("prompt") or {}),
        num_samples=int(body.get("num_samples", 1)),
        max_tokens=params.get("max_tokens"),
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=int(params.get("top_k", -1)),
        seed=params.get("seed"),
        stop=stop_strings(params.get("stop"), eos_ids),
    )


def sequences_json(sequences: Sequence[SampledSequence]) -> dict[str, Any]:
    """``SampleResponse`` as JSON (for a caller that does not ask for protobuf)."""
    return {
        "type": "sample",
        "sequences": [
            {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
            for s in sequences
        ],
    }


def forward_json(result: ForwardResult) -> dict[str, Any]:
    def tensor(a: np.ndarray) -> dict[str, Any]:
        return {"data": a.tolist(), "dtype": "float32", "shape": list(a.shape)}

    outputs = [
        {"logprobs": tensor(lp), "elementwise_loss": tensor(loss)}
        for lp, loss in zip(result.logprobs, result.losses, strict=True)
    ]
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": outputs,
        "metrics": result.metrics,
    }
