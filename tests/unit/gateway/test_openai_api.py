"""The OpenAI shapes, pure: bodies to GenerateRequest, refusals by name, statuses, and the
JSON that chunks become (no service runs here)."""

from __future__ import annotations

import json

import grpc
import pytest

from specserve.gateway.openai_api import CHAT, COMPLETIONS, ApiError, parse, to_generate
from specserve.gateway.openai_responses import Completion
from specserve.v1 import common_pb2, generation_pb2


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


def refused(kind: str, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(kind, raw)
    assert err.value.status == 400
    return err.value


def test_a_chat_body_maps_onto_the_gateways_request():
    messages = [
        {"role": "developer", "content": "Talk like a pirate."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    req = to_generate(parse(CHAT, body(messages=messages, stop="END", max_completion_tokens=9)))
    assert [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "Talk like a pirate."),  # developer is OpenAI's newer name for system
        ("user", "a\nb"),
    ]
    assert list(req.stop) == ["END"] and req.max_tokens == 9
    assert req.sampling.temperature == 1.0  # OpenAI's default: it samples
    assert not req.sampling.HasField("seed")
    assert req.priority == common_pb2.PRIORITY_CLASS_INTERACTIVE
    flex = to_generate(parse(CHAT, body(messages=messages, service_tier="flex", seed=7)))
    assert flex.priority == common_pb2.PRIORITY_CLASS_BATCH and flex.sampling.seed == 7
    assert to_generate(parse(CHAT, body(messages=messages))).max_tokens == 0  # the gateway's


def test_a_completions_body_takes_text_or_token_ids():
    req = to_generate(parse(COMPLETIONS, body(prompt="def f():", temperature=0, top_p=0.5)))
    assert req.prompt == "def f():" and req.max_tokens == 16  # OpenAI's default
    assert req.sampling.temperature == 0 and req.sampling.top_p == 0.5
    assert list(to_generate(parse(COMPLETIONS, body(prompt=[5, 6]))).prompt_ids.ids) == [5, 6]
    assert to_generate(parse(COMPLETIONS, body(prompt=["one"]))).prompt == "one"
    assert list(to_generate(parse(COMPLETIONS, body(prompt=[[1, 2]]))).prompt_ids.ids) == [1, 2]


@pytest.mark.parametrize(
    "kind,fields,param",
    [
        (COMPLETIONS, {"prompt": "x", "n": 3}, "n"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "seed": -1}, "seed"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "top_k": 2**40}, "top_k"),
        (COMPLETIONS, {"prompt": [2**40]}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        (COMPLETIONS, {}, "prompt"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content.0",
        ),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools.0.type"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
            "tool_choice",
        ),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(kind, fields, param):
    assert refused(kind, body(**fields)).param == param


def test_what_is_not_a_json_object_is_refused():
    for raw in (b"", b"{", b"[1]", b'"x"', b"\xff\xfe", b'{"prompt": "x"}'):
        assert refused(COMPLETIONS, raw).message


def test_grpc_statuses_become_openai_errors():
    e = ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be in [1, 8]")
    assert (e.status, e.param, e.type) == (400, "max_tokens", "invalid_request_error")
    e = ApiError.from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "2 concurrent streams", 1500)
    assert e.status == 429 and e.headers == {"Retry-After": "2", "retry-after-ms": "1500"}
    assert e.code == "rate_limit_exceeded"
    e = ApiError.from_status(grpc.StatusCode.CANCELLED, "cancelled")
    assert e.status == 409 and e.headers == {"x-should-retry": "false"}  # (not sent again)
    assert ApiError.from_status(grpc.StatusCode.UNAUTHENTICATED, "no key").status == 401
    assert ApiError.from_status(grpc.StatusCode.PERMISSION_DENIED, "tier").status == 403
    assert ApiError.from_status(grpc.StatusCode.UNAVAILABLE, "retry").status == 503
    assert ApiError.from_status(grpc.StatusCode.UNKNOWN, "?").status == 500
    e = ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, "the prompt: too long")
    assert e.param is None  # (not a field name)


def final_chunk(rid: str) -> generation_pb2.GenerateResponse:
    final = generation_pb2.FinalInfo(finish_reason=common_pb2.FINISH_REASON_EOS)
    final.usage.prompt_tokens, final.usage.completion_tokens = 5, 2
    final.speculation.steps, final.speculation.accepted_tokens = 2, 1
    return generation_pb2.GenerateResponse(request_id=rid, text="!", final=final)


def test_a_chat_stream_opens_with_the_role_and_ends_with_usage():
    c = Completion(CHAT, "m", include_usage=True)
    first = generation_pb2.GenerateResponse(request_id="r", text="Hi")
    opening = c.first_chunk(first)
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    (mid,) = c.chunks(first)
    assert opening["id"] == mid["id"] == "chatcmpl-r"  # one id for the whole stream
    assert mid["choices"][0]["delta"] == {"content": "Hi"}
    assert mid["usage"] is None and mid["object"] == "chat.completion.chunk"
    last, usage = c.chunks(final_chunk("r"))
    assert last["choices"][0] == {
        "index": 0,
        "delta": {"content": "!"},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert last["speculation"]["steps"] == 2 and usage["choices"] == []
    assert usage["usage"]["total_tokens"] == 7
    assert c.response()["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}


def test_a_completion_answers_in_one_body():
    c = Completion(COMPLETIONS, "m")
    assert c.first_chunk(generation_pb2.GenerateResponse(request_id="r")) is None
    c.add(generation_pb2.GenerateResponse(request_id="r", text="a"))
    c.add(final_chunk("r"))
    whole = c.response()
    assert whole["object"] == "text_completion" and whole["id"] == "cmpl-r"
    assert whole["choices"][0]["text"] == "a!" and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == 2 and whole["speculation"]["accepted_tokens"] == 1
