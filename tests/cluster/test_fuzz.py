"""Hostile input over real gRPC: hypothesis throws random and malformed requests at the public
API. Every one gets a clean status (or a normal answer), never an internal error or a hang,
and the gateway serves a normal request right after. Each call has a deadline well past what
an answer takes here: a call that runs into it hung, and fails the test."""

from __future__ import annotations

import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import generate, request
from specserve.v1 import common_pb2, generation_pb2

pytestmark = pytest.mark.cluster  # every test here runs a cluster

# What a hostile request may get back; anything else (UNKNOWN, INTERNAL, ...) is a bug.
CLEAN = {
    grpc.StatusCode.ALREADY_EXISTS,  # a request_id drawn again for another request
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
CASES = 150
# A valid fuzz request asks for at most 3 tokens of a tiny model, and a refusal is immediate.
DEADLINE_S = 20
HUNG = f"hung: no answer within {DEADLINE_S} s"
ran = {"cases": 0, "ok": 0}

FIELDS = (
    "input",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "priority",
    "request_id",
    "tree_size",
    "resume_from",
    "session_id",
)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from(
    [math.nan, -1.0, 1e30, -math.inf]
)
ints32 = st.integers(-(2**31), 2**31 - 1)
text = st.text(max_size=40) | st.text(min_size=5000, max_size=20000)


@st.composite
def requests(draw) -> generation_pb2.GenerateRequest:
    """A sane request with up to three fields drawn from anything their type can hold."""
    bad = draw(st.sets(st.sampled_from(FIELDS), max_size=3))
    req = generation_pb2.GenerateRequest(max_tokens=draw(st.integers(1, 3)))
    kind = draw(st.sampled_from(["prompt", "ids", "messages"]))
    if "input" in bad:
        kind = draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if kind == "prompt":
        req.prompt = draw(text if "input" in bad else st.text(min_size=1, max_size=40))
    elif kind == "ids":
        valid = st.lists(st.integers(0, 1000), min_size=1, max_size=20)
        req.prompt_ids.ids.extend(draw(st.lists(ints32, max_size=50) if "input" in bad else valid))
    elif kind == "messages":
        content = text if "input" in bad else st.text(min_size=1, max_size=40)
        role = st.text(max_size=12) if "input" in bad else st.sampled_from(["user", "system"])
        for r, c in draw(st.lists(st.tuples(role, content), min_size=1, max_size=3)):
            req.messages.messages.add(role=r, content=c)
    if "max_tokens" in bad:
        req.max_tokens = draw(st.integers(-(2**31), 0) | st.integers(10**6, 2**31 - 1))
    sampling = req.sampling
    sampling.temperature = draw(floats if "temperature" in bad else st.sampled_from([0.0, 0.8]))
    sampling.top_p = draw(floats if "top_p" in bad else st.sampled_from([0.0, 0.9]))
    sampling.top_k = draw(ints32 if "top_k" in bad else st.sampled_from([0, 5]))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    if "stop" in bad:
        req.stop.extend(draw(st.lists(st.text(max_size=200), max_size=40) | st.just(["x"] * 3000)))
    req.priority = draw(st.integers(-3, 5) if "priority" in bad else st.sampled_from([0, 1, 2]))
    if "request_id" in bad:
        req.request_id = draw(st.text(max_size=300))
    elif draw(st.booleans()):
        req.request_id = draw(st.from_regex(r"fz[A-Za-z0-9._:-]{1,20}", fullmatch=True))
    req.speculation.tree_size = draw(
        st.integers(257, 2**31 - 1) if "tree_size" in bad else st.integers(0, 8)
    )
    if "resume_from" in bad:
        req.resume_from = draw(ints32)
    if "session_id" in bad:
        req.session_id = draw(st.text(max_size=300))
    return req


def call(gateway, req) -> None:
    ran["cases"] += 1
    try:
        chunks = list(gateway.Generate(req, timeout=DEADLINE_S))
    except grpc.RpcError as e:
        assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, HUNG
        assert e.code() in CLEAN, (e.code(), e.details())
        assert e.details() and "Traceback" not in e.details()
        return
    assert chunks and chunks[-1].HasField("final")
    ran["ok"] += 1


@settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(req=requests())
def test_random_requests_get_clean_statuses(gateway, req):
    call(gateway, req)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=300) | st.just(b"\x0a\x03\xff\xfe\xfd"))
def test_random_bytes_get_clean_statuses(tiny_cluster, raw):
    with grpc.insecure_channel(tiny_cluster.procs["gateway"].address) as channel:
        method = channel.unary_stream(
            "/specserve.v1.GenerationService/Generate",
            request_serializer=lambda b: b,
            response_deserializer=generation_pb2.GenerateResponse.FromString,
        )
        try:
            list(method(raw, timeout=DEADLINE_S))
        except grpc.RpcError as e:
            assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, HUNG
            assert e.code() in CLEAN, (e.code(), e.details())


def test_an_oversized_message_is_refused_cleanly(gateway):
    req = request(prompt="x" * (5 * 1024 * 1024), max_tokens=2)
    with pytest.raises(grpc.RpcError) as err:
        list(gateway.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_gateway_is_healthy_and_serves_after_the_fuzzing(gateway, tiny_cluster):
    print(f"\nfuzz: {ran['cases']} random requests, {ran['ok']} of them valid and served")
    with grpc.insecure_channel(tiny_cluster.procs["gateway"].address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    final = generate(gateway, request(prompt="def f():", max_tokens=4)).final
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
