"""Every GenerateRequest field is checked in one place, NaN and infinities included, and a bad
value is INVALID_ARGUMENT naming the field (never a retryable status, never UNKNOWN).

Also: the proto "unset vs 0" rule of ``convert``, the wire-format walk that names a string
field holding bytes that are not UTF-8, and the OpenAI body mapping of the router's HTTP front.
"""

from __future__ import annotations

import math
from dataclasses import replace

import grpc
import pytest

from rlfleet.common.errors import InvalidArgument
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.proto_decode import bad_utf8_field
from rlfleet.proto import common_pb2, rollout_pb2
from rlfleet.rollout.convert import request_from_proto, request_to_proto
from rlfleet.rollout.gateway import openai_api as oai
from rlfleet.rollout.types import GenerateRequest, InvalidField, SamplingParams

NAN, INF = math.nan, math.inf


def good() -> GenerateRequest:
    return GenerateRequest("r1", SamplingParams(n=2, max_tokens=4), prompt_text="1+2=")


BAD_SAMPLING = [
    ("sampling.n", {"n": 0}),
    ("sampling.n", {"n": -1}),
    ("sampling.n", {"n": 5000}),
    ("sampling.n", {"n": 2.0}),
    ("sampling.n", {"n": True}),
    ("sampling.max_tokens", {"max_tokens": 0}),
    ("sampling.max_tokens", {"max_tokens": 1 << 20}),
    ("sampling.temperature", {"temperature": NAN}),
    ("sampling.temperature", {"temperature": INF}),
    ("sampling.temperature", {"temperature": -0.5}),
    ("sampling.temperature", {"temperature": "1"}),
    ("sampling.top_p", {"top_p": NAN}),
    ("sampling.top_p", {"top_p": 0.0}),
    ("sampling.top_p", {"top_p": 1.5}),
    ("sampling.top_p", {"top_p": -INF}),
    ("sampling.top_k", {"top_k": -1}),
    ("sampling.top_k", {"top_k": 1 << 40}),
    ("sampling.stop", {"stop": [""]}),
    ("sampling.stop", {"stop": "x"}),
    ("sampling.stop", {"stop": ["a"] * 65}),
    ("sampling.stop", {"stop": [3]}),
    ("sampling.seed", {"seed": 1 << 64}),
    ("sampling.seed", {"seed": 1.5}),
    ("sampling.logprobs", {"logprobs": 2}),
    ("sampling.logprobs", {"logprobs": -1}),
]
BAD_REQUEST = [
    ("request_id", {"request_id": ""}),
    ("request_id", {"request_id": "x" * 257}),
    ("request_id", {"request_id": 5}),
    ("request_id", {"request_id": "a\nb"}),
    ("session_id", {"session_id": "s" * 257}),
    ("prompt", {"prompt_text": None}),
    ("prompt", {"prompt_text": ""}),
    ("prompt_token_ids", {"prompt_text": None, "prompt_token_ids": [1, -2]}),
    ("prompt_token_ids", {"prompt_text": None, "prompt_token_ids": [1 << 31]}),
    ("min_weight_version", {"min_weight_version": -1}),
    ("min_weight_version", {"min_weight_version": 1.0}),
    ("timeout_s", {"timeout_s": NAN}),
    ("timeout_s", {"timeout_s": INF}),
    ("timeout_s", {"timeout_s": -1.0}),
    ("timeout_s", {"timeout_s": 1e9}),
    ("sampling", {"sampling": None}),
]


@pytest.mark.parametrize(("field", "change"), BAD_SAMPLING)
def test_bad_sampling_value_is_refused_naming_the_field(field: str, change: dict) -> None:
    request = good()
    request.sampling = replace(request.sampling, **change)
    with pytest.raises(InvalidField) as refused:
        request.validate()
    assert refused.value.field == field and str(refused.value).startswith(field)


@pytest.mark.parametrize(("field", "change"), BAD_REQUEST)
def test_bad_request_value_is_refused_naming_the_field(field: str, change: dict) -> None:
    with pytest.raises(InvalidField) as refused:
        replace(good(), **change).validate()
    assert refused.value.field == field and field in str(refused.value)
    assert isinstance(refused.value, InvalidArgument)  # INVALID_ARGUMENT, HTTP 400


def test_good_values_pass() -> None:
    good().validate()
    sampling = SamplingParams(
        n=1024, temperature=0, top_p=1e-6, top_k=50, max_tokens=1, stop=["\n"], seed=-5, logprobs=0
    )
    GenerateRequest("r", sampling, prompt_token_ids=[0, 5], timeout_s=86_400).validate()


def test_queued_json_with_nan_round_trips_and_is_refused() -> None:
    request = good()
    request.timeout_s = NAN
    with pytest.raises(InvalidField, match="timeout_s"):
        GenerateRequest.from_json(request.to_json()).validate()


def test_proto_without_sampling_gets_defaults_but_explicit_zeros_are_refused() -> None:
    bare = rollout_pb2.GenerateRequest(request_id="a", prompt_text="1+2=")
    assert request_from_proto(bare).sampling == SamplingParams()
    for field in ("n", "max_tokens"):
        msg = request_to_proto(good())
        msg.sampling.ClearField(field)
        with pytest.raises(InvalidField, match=f"sampling.{field}"):
            request_from_proto(msg).validate()


def test_proto_documented_zeros_keep_meaning_unset() -> None:
    msg = request_to_proto(good())
    msg.sampling.top_p, msg.sampling.top_k = 0.0, -3
    parsed = request_from_proto(msg)
    parsed.validate()
    assert (parsed.sampling.top_p, parsed.sampling.top_k) == (1.0, 0)


def test_bad_utf8_field_is_named_even_when_nested() -> None:
    ok = rollout_pb2.GenerateBatchRequest(requests=[request_to_proto(good())])
    ok.requests[0].sampling.stop.append("STOPX")
    raw = ok.SerializeToString()
    assert bad_utf8_field(rollout_pb2.GenerateBatchRequest.DESCRIPTOR, raw) is None
    broken = raw.replace(b"STOPX", b"ST\xffPX")
    where = bad_utf8_field(rollout_pb2.GenerateBatchRequest.DESCRIPTOR, broken)
    assert where == "requests.sampling.stop"


async def test_unparsable_request_is_invalid_argument_naming_the_field() -> None:
    """A real aio server: the parse failure happens before any handler runs."""
    from rlfleet.rollout.router.server import registrations

    server = GrpcServer(registrations(None), "127.0.0.1", 0)  # never reaches the core
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        call = channel.unary_unary("/rlfleet.v1.Rollout/Generate")
        raw = request_to_proto(replace(good(), prompt_text="ok?")).SerializeToString()
        for payload, field in (
            (raw.replace(b"ok?", b"o\xfe?"), "prompt_text"),
            (raw[:-3], "could not be parsed"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(payload, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in refused.value.details()
    finally:
        await channel.close()
        await server.stop(0)


# ---- the HTTP front's mapping of OpenAI bodies -------------------------------------------


def completion(**fields) -> oai.CompletionBody:
    return oai.CompletionBody(prompt="1+2=", **fields)


def test_completion_defaults_follow_openai() -> None:
    sampling = oai.completion_sampling(completion())
    assert (sampling.n, sampling.max_tokens, sampling.temperature, sampling.top_p) == (1, 16, 1, 1)
    assert sampling.logprobs == 0 and oai.completion_sampling(completion(logprobs=0)).logprobs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "sampling.n"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
        ({"temperature": NAN}, "sampling.temperature"),
        ({"top_p": 0}, "sampling.top_p"),
        ({"stop": ""}, "sampling.stop"),
        ({"min_weight_version": -1}, "min_weight_version"),
    ],
)
def test_explicit_bad_completion_values_are_refused_like_grpc(fields: dict, param: str) -> None:
    body = completion(**fields)
    with pytest.raises(InvalidField) as refused:
        oai.requests_for(oai.prompts_of(body), oai.completion_sampling(body), body, "")
    assert refused.value.field == param


@pytest.mark.parametrize(
    ("fields", "param"), [({"logprobs": 3}, "logprobs"), ({"echo": True}, "echo")]
)
def test_unsupported_completion_options_are_refused(fields: dict, param: str) -> None:
    with pytest.raises(InvalidField) as refused:
        oai.completion_sampling(completion(**fields))
    assert refused.value.field == param


def test_prompt_forms_and_session() -> None:
    for prompt, count in (("a", 1), (["a", "b"], 2), ([1, 2, 3], 1), ([[1], [2, 3]], 2)):
        assert len(oai.prompts_of(oai.CompletionBody(prompt=prompt))) == count
    assert oai.session_of(completion(user="u1"), None) == "u1"
    assert oai.session_of(completion(user="u1"), "hdr") == "hdr"


def test_chat_default_max_tokens_fills_the_context() -> None:
    body = oai.ChatBody(messages=[oai.ChatMessage(role="user", content="hi")])
    assert oai.chat_sampling(body, prompt_len=10, max_model_len=64).max_tokens == 54
    body = oai.ChatBody(messages=[oai.ChatMessage(role="user", content="hi")], max_tokens=0)
    with pytest.raises(InvalidField, match="max_tokens"):
        oai.chat_sampling(body, 10, 64).validate()
    assert oai.chat_messages(
        oai.ChatBody(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        )
    ) == [{"role": "user", "content": "ab"}]


def test_stream_chunks_end_with_usage_when_asked() -> None:
    response = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "3"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    first, last = oai.stream_chunks(response, chat=True, include_usage=True)
    assert (
        first["object"] == "chat.completion.chunk"
        and first["choices"][0]["delta"]["content"] == "3"
    )
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 2


def test_sampling_proto_field_names_match_the_dataclass() -> None:
    """The validation names (``sampling.<field>``) are the proto's field names too."""
    proto_fields = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    assert proto_fields == set(SamplingParams.__dataclass_fields__)
