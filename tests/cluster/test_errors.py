"""Bad input, a full queue, and cancellation, over real gRPC."""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from helpers import generate, request
from specserve.gateway.validation import _lenient_class
from specserve.store import req_key
from specserve.v1 import common_pb2, generation_pb2, verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.cluster  # every test here runs a cluster

BAD = {
    "empty prompt": (request(prompt=""), "prompt"),
    "no prompt at all": (request(), "input"),
    "empty prompt ids": (request(prompt_ids=[]), "prompt_ids"),
    "negative max_tokens": (request(prompt="hi", max_tokens=-1), "max_tokens"),
    "max_tokens above the limit": (request(prompt="hi", max_tokens=5000), "max_tokens"),
    "prompt longer than max_seq_len": (request(prompt_ids=[1] * 2048), "prompt"),
    "token out of vocabulary": (request(prompt_ids=[1, 10**7]), "prompt_ids.ids[1]"),
    "negative temperature": (
        request(prompt="hi", sampling=common_pb2.SamplingParams(temperature=-1)),
        "sampling.temperature",
    ),
    "NaN temperature": (
        request(prompt="hi", sampling=common_pb2.SamplingParams(temperature=float("nan"))),
        "sampling.temperature",
    ),
    "top_p above 1": (
        request(prompt="hi", sampling=common_pb2.SamplingParams(top_p=1.5)),
        "sampling.top_p",
    ),
    "negative top_k": (
        request(prompt="hi", sampling=common_pb2.SamplingParams(top_k=-3)),
        "sampling.top_k",
    ),
    "unknown priority": (request(prompt="hi", priority=7), "priority"),
    "too many stop strings": (request(prompt="hi", stop=["x"] * 100), "stop"),
    "empty stop string": (request(prompt="hi", stop=[""]), "stop[0]"),
    "bad request id": (request(prompt="hi", request_id="a b"), "request_id"),
    "unknown chat role": (None, "messages[0].role"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_argument_names_the_field(gateway, case):
    req, field = BAD[case]
    if req is None:
        req = request()
        req.messages.messages.add(role="wizard", content="hi")
    with pytest.raises(grpc.RpcError) as err:
        generate(gateway, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field), err.value.details()


def test_invalid_utf8_is_invalid_argument(tiny_cluster):
    lenient = _lenient_class()()
    lenient.prompt = b"caf\xc3("  # a broken two-byte sequence
    lenient.max_tokens = 4
    channel = grpc.insecure_channel(tiny_cluster.procs["gateway"].address)
    call = channel.unary_stream(
        "/specserve.v1.GenerationService/Generate",
        request_serializer=lambda b: b,
        response_deserializer=generation_pb2.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(call(lenient.SerializeToString(), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt"), err.value.details()
    channel.close()


def _verifier_status(cluster) -> verifier_pb2.StatusResponse:
    with grpc.insecure_channel(cluster.procs["verifier"].address) as ch:
        return verifier_pb2_grpc.VerifierServiceStub(ch).Status(
            verifier_pb2.StatusRequest(), timeout=5
        )


def _wait_batch_empty(cluster, rid: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while rid in _verifier_status(cluster).request_ids:
        assert time.monotonic() < deadline, "cancelled request still in the verifier's batch"
        time.sleep(0.05)


def test_client_disconnect_cancels_the_work(gateway, tiny_cluster):
    rid = "disconnect-1"
    call = gateway.Generate(request(prompt="Once", max_tokens=1000, request_id=rid), timeout=60)
    next(call)
    assert rid in _verifier_status(tiny_cluster).request_ids
    call.cancel()
    _wait_batch_empty(tiny_cluster, rid)
    r = redis.Redis.from_url(tiny_cluster.redis_url, decode_responses=True)
    assert r.hget(req_key(rid), "status") == "cancelled"
    assert int(r.hget(req_key(rid), "generated")) < 1000


def test_cancel_rpc_stops_the_stream(gateway, tiny_cluster):
    rid = "cancel-rpc-1"
    call = gateway.Generate(request(prompt="Once", max_tokens=1000, request_id=rid), timeout=60)
    next(call)
    assert gateway.Cancel(generation_pb2.CancelRequest(request_id=rid), timeout=5).cancelled
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    _wait_batch_empty(tiny_cluster, rid)
    assert not gateway.Cancel(generation_pb2.CancelRequest(request_id=rid), timeout=5).cancelled


def test_a_temperature_near_zero_decodes_greedily_over_grpc(gateway):
    """1e-40 passes validation; it once made every step fail (inf logits) until the deadline."""
    cold = common_pb2.SamplingParams(temperature=1e-40, seed=3)
    hostile = generate(gateway, request(prompt="Once upon", max_tokens=8, sampling=cold), 30)
    greedy = generate(gateway, request(prompt="Once upon", max_tokens=8))
    assert hostile.ids == greedy.ids and len(hostile.ids) == 8
    assert hostile.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
