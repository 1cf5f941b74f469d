"""The gRPC port's own reading of a call (grpc_api.py): a request's bytes parsed, or the string
field holding invalid UTF-8 named for the INVALID_ARGUMENT it gets; and, on a real in-process
grpc.aio server, the caller's key from its `authorization` header and its deadline (none when
it set none)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specserve.gateway.grpc_api import _authorization, _BadBytes, _deadline, _deserialize
from specserve.v1 import common_pb2, generation_pb2


def with_bad_utf8(req: generation_pb2.GenerateRequest, nth: int = 0) -> bytes:
    """The request's bytes with the `nth` "é" it holds made invalid UTF-8 (same length)."""
    raw = req.SerializeToString()
    at = -1
    for _ in range(nth + 1):
        at = raw.index("é".encode(), at + 1)
    return raw[:at] + b"\xff\xfe" + raw[at + 2 :]


def test_a_requests_bytes_parse_into_the_request():
    req = generation_pb2.GenerateRequest(
        prompt="héllo", max_tokens=5, sampling=common_pb2.SamplingParams(seed=1)
    )
    assert _deserialize(req.SerializeToString()) == req


def chat(*contents: str) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest()
    for content in contents:
        req.messages.messages.add(role="user", content=content)
    return req


@pytest.mark.parametrize(
    "req,nth,field",
    [
        (generation_pb2.GenerateRequest(prompt="héllo"), 0, "prompt"),
        (generation_pb2.GenerateRequest(prompt="x", stop=["a", "é"]), 0, "stop[1]"),
        (generation_pb2.GenerateRequest(prompt="é", stop=["é"]), 1, "stop[0]"),
        (chat("ok", "é"), 0, "messages.messages[1].content"),
        (generation_pb2.GenerateRequest(prompt="x", request_id="é"), 0, "request_id"),
    ],
    ids=["prompt", "stop", "second-stop", "message", "request_id"],
)
def test_a_string_field_holding_invalid_utf8_is_named(req, nth, field):
    parsed = _deserialize(with_bad_utf8(req, nth))
    assert isinstance(parsed, _BadBytes) and parsed.field == field


def test_bytes_that_are_no_request_at_all_are_named_the_request():
    parsed = _deserialize(b"\xff\xff\xff")
    assert isinstance(parsed, _BadBytes) and parsed.field == "request"


def test_a_calls_key_and_deadline_are_read_from_its_headers():
    async def seen(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        deadline = _deadline(context)
        left = "none" if deadline is None else f"{deadline - time.monotonic():.1f}"
        return f"{_authorization(context)}|{left}".encode()

    async def call_twice() -> tuple[str, str]:
        server = grpc.aio.server()
        methods = {"Seen": grpc.unary_unary_rpc_method_handler(seen)}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Headers", methods),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                method = channel.unary_unary("/test.Headers/Seen")
                keyed = await method(
                    b"", timeout=30, metadata=(("authorization", "Bearer ssk_a_b"),)
                )
                bare = await method(b"")
        finally:
            await server.stop(None)
        return keyed.decode(), bare.decode()

    keyed, bare = asyncio.run(call_twice())
    key, left = keyed.split("|")
    assert key == "Bearer ssk_a_b" and 28 < float(left) < 31  # (grpc's clock, to 0.1 s)
    assert bare == "|none"  # (no key, and no deadline: not one ten years out)
