"""Re-attaching to a request's stream from an index: after a lost connection or a dead gateway."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import yaml

from conftest import cluster_config
from helpers import Result, generate, request
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import generation_pb2, generation_pb2_grpc
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.cluster  # every test here runs a cluster


def resume(stub, rid: str, index: int) -> Result:
    req = generation_pb2.GenerateRequest(request_id=rid, resume_from=index)
    return Result(list(stub.Generate(req, timeout=60)))


def test_resume_streams_the_rest_from_an_index(gateway, tokenizer):
    full = generate(gateway, request(prompt="x = [1, 2", max_tokens=20, request_id="resume-1"))
    for index in (0, 7, 20, 25):
        rest = resume(gateway, "resume-1", index)
        assert rest.ids == full.ids[index:]
        indices = [c.first_index for c in rest.chunks if c.token_ids]
        assert indices[:1] == ([index] if index < 20 else [])
        assert rest.final.finish_reason == full.final.finish_reason
    assert resume(gateway, "resume-1", 0).text == full.text
    rest = resume(gateway, "resume-1", 7)
    assert rest.text and full.text.endswith(rest.text)


@pytest.mark.parametrize(
    "rid,index,code",
    [
        ("", 3, grpc.StatusCode.INVALID_ARGUMENT),
        ("resume-none", -1, grpc.StatusCode.INVALID_ARGUMENT),
        ("no-such-request", 0, grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_resume_requests_get_a_clear_status(gateway, rid, index, code):
    with pytest.raises(grpc.RpcError) as err:
        resume(gateway, rid, index)
    assert err.value.code() == code
    assert err.value.details()


def test_a_client_resumes_on_a_new_gateway_after_its_gateway_dies(
    tmp_path, tiny_model_dir, tiny_model, tokenizer
):
    cluster = LocalCluster(cluster_config(tiny_model_dir), tmp_path).start(timeout=180)
    try:
        ids = tokenizer("def fibonacci(n):").input_ids
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            req = request(prompt_ids=ids, max_tokens=800, request_id="survives-gateway")
            stream = stub.Generate(req, timeout=120)
            received = [next(stream)]
            cluster.kill("gateway")
            with pytest.raises(grpc.RpcError) as err:
                received.extend(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        got = [t for c in received for t in c.token_ids]
        scheduler = cluster.procs["scheduler"].address
        gateway = cluster.start_service(
            "gateway", {"SPECSERVE_GATEWAY_SCHEDULER_ADDRESS": scheduler}
        )
        cluster.wait_ready("gateway", 120)
        with grpc.insecure_channel(gateway.address) as channel:
            rest = resume(
                generation_pb2_grpc.GenerationServiceStub(channel), "survives-gateway", len(got)
            )
        assert rest.chunks[0].first_index == len(got) or not rest.ids
        assert got + rest.ids == hf_greedy(tiny_model, ids, 800)
        assert rest.final.usage.completion_tokens == 800
    finally:
        cluster.stop()


def test_two_thousand_clients_re_attaching_at_once_all_get_their_streams(tmp_path, tiny_model_dir):
    """After a gateway restarts, its clients re-attach together. A grpc.aio server takes new
    calls one loop turn at a time, and C-core refused the calls waiting past its default
    backlog of 1,000 with CANCELLED; the gateway lets its whole `max_concurrent_rpcs` wait."""
    streams, vid = 2000, "stand-in-verifier"
    cluster = LocalCluster(cluster_config(tiny_model_dir), tmp_path)
    cluster.start_redis()
    store = RequestStore.from_url(cluster.redis_url)
    store.ensure_queues()
    rids = [f"burst-{i}" for i in range(streams)]
    final = {"finish_reason": "FINISH_REASON_LENGTH", "usage": {"completion_tokens": 3}}
    for rid in rids:  # each one ran to its end on a verifier while its client was away
        store.create(
            rid, {"request_id": rid, "prompt_ids": [1, 2], "max_tokens": 3}, "batch", 10**9
        )
        store.claim(rid, vid, int(time.time() * 1000))
        store.commit_step(vid, [(rid, 0, [5, 6, 7])])
        store.finish(rid, vid, "finished", final, "batch")
    cluster.config["common"]["redis_url"] = cluster.redis_url
    cluster.config_path.write_text(yaml.safe_dump(cluster.config))

    async def attach_all(address: str) -> list[str | list[int]]:
        channels = [grpc.aio.insecure_channel(address) for _ in range(streams // 100)]
        stubs = [generation_pb2_grpc.GenerationServiceStub(c) for c in channels]

        async def one(i: int) -> str | list[int]:
            req = generation_pb2.GenerateRequest(request_id=rids[i], resume_from=0)
            try:
                chunks = [c async for c in stubs[i // 100].Generate(req, timeout=120)]
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return [t for c in chunks for t in c.token_ids]

        try:
            return await asyncio.gather(*(one(i) for i in range(streams)))
        finally:
            for channel in channels:
                await channel.close()

    try:
        gateway = cluster.start_service("gateway")  # (no scheduler: nothing is submitted)
        cluster.wait_ready("gateway", 120)
        results = asyncio.run(attach_all(gateway.address))
    finally:
        cluster.stop()
    failed = [r for r in results if not isinstance(r, list)]
    assert not failed, f"{len(failed)} of {streams} failed: {sorted(set(failed))}"
    assert all(r == [5, 6, 7] for r in results)
