"""The Tinker API's bodies (rlfleet.trainer.tinker.convert) against the official SDK's own
encoders and decoders: what the SDK sends is read as sent, what we answer it reads back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from rlfleet.common.errors import InvalidArgument
from rlfleet.trainer.tinker import convert
from rlfleet.trainer.tinker.checks import stop_strings
from rlfleet.trainer.tinker.types import ForwardResult, SampledSequence


def sdk_body(data: list[types.Datum], loss_fn: str = "ppo", config=None) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="session-1:train:0",
        seq_id=3,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_forward_backward_body_reads_as_the_sdk_wrote_it() -> None:
    targets = torch.tensor([[5, 0], [0, 7]])  # 2-D: the SDK sends it sparse (CSR)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 5, 6]),
            loss_fn_inputs={
                "target_tokens": [5, 6, 7],
                "logprobs": [-0.5, -1.0, -2.0],
                "advantages": np.array([0.0, 1.0, -1.0], np.float32),
            },
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2]),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_torch_sparse(targets),
                "weights": [1.0, 1.0],
            },
        ),
    ]
    call = convert.forward_call(sdk_body(data, config={"clip_low_threshold": 0.7}))
    assert (call.model_id, call.seq_id, call.loss_fn) == ("session-1:train:0", 3, "ppo")
    assert call.config == {"clip_low_threshold": pytest.approx(0.7)}
    first, second = call.data
    assert first.tokens == [1, 5, 6] and first.inputs["target_tokens"].tolist() == [5, 6, 7]
    assert first.inputs["advantages"].tolist() == [0.0, 1.0, -1.0]
    assert second.inputs["target_tokens"].tolist() == [[5, 0], [0, 7]]


def test_our_answers_read_back_in_the_sdk() -> None:
    result = ForwardResult(
        [np.array([-0.5, -1.5], np.float32), np.array([-2.0], np.float32)],
        [np.array([0.5, 1.5], np.float32), np.array([2.0], np.float32)],
        {"loss:sum": 4.0},
    )
    out = deserialize_forward_backward_output(convert.forward_output(result))
    assert out.metrics == {"loss:sum": 4.0}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.5], [-2.0]]
    sequences = [
        SampledSequence([4, 2], [-0.25, -0.5], "stop"),
        SampledSequence([3], [-1.0], "length"),
    ]
    sample = deserialize_sample_response(convert.sample_response(sequences))
    assert [s.tokens for s in sample.sequences] == [[4, 2], [3]]
    assert [s.stop_reason for s in sample.sequences] == ["stop", "length"]
    assert sample.sequences[0].logprobs == [-0.25, -0.5]


def test_unsupported_inputs_are_refused_by_name() -> None:
    image = types.ModelInput(chunks=[types.ImageChunk(data=b"x", format="png")])
    with pytest.raises(InvalidArgument, match="image chunks"):
        convert.forward_call(sdk_body([types.Datum(model_input=image, loss_fn_inputs={})]))
    with pytest.raises(InvalidArgument, match="include_prompt_logprobs"):
        convert.sample_spec({"prompt_logprobs": True}, {2})
    with pytest.raises(InvalidArgument, match="dimuon"):
        convert.lora_spec({"lora_config": {"rank": 4}, "optimizer_config": {"type": "dimuon"}})
    with pytest.raises(InvalidArgument, match="full fine-tuning"):
        convert.lora_spec({})


def test_stop_takes_strings_and_end_of_sequence_ids_only() -> None:
    assert stop_strings(None, {2}) == [] and stop_strings("\n", {2}) == ["\n"]
    assert stop_strings([2], {2}) == []
    with pytest.raises(InvalidArgument, match="stop token ids"):
        stop_strings([7], {2})
    with pytest.raises(InvalidArgument, match=r"stop=\[\]"):
        stop_strings([], {2})
