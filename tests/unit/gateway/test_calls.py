"""A Generate call's end around the core (calls.py), on a private Redis: the status it is
counted and audited with (its finish reason, the error it ended with, or CANCELLED when its
client left first), its stream slot and unused tokens given back before its audit record is
written, and a call refused before the core counted and audited alike. (No scheduler runs
here: the calls end without a request to cancel.)"""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import REGISTRY

from specserve.common.settings import Tier
from specserve.gateway.audit import Audit, Call
from specserve.gateway.calls import Calls
from specserve.gateway.keys import KeyStore, Principal
from specserve.gateway.quotas import Quotas
from specserve.gateway.streaming import Streams
from specserve.gateway.tails import Tails
from specserve.store import AUDIT_STREAM, RequestStore
from specserve.tools.local_cluster import free_port
from specserve.v1 import scheduler_pb2_grpc

WHO = Principal("k1", "acme", "custom", Tier(concurrent_streams=1, tokens_per_minute=100))


def requests_counted(priority: str, status: str, pool: str) -> float:
    labels = {"priority": priority, "status": status, "pool": pool}
    return REGISTRY.get_sample_value("specserve_gateway_requests_total", labels) or 0.0


def audited(store: RequestStore) -> list[dict[str, str]]:
    return [fields for _, fields in store.r.xrange(AUDIT_STREAM)]


async def gateway_calls(store: RequestStore, work) -> None:
    """Runs `work(calls, quotas)` on a gateway's Calls over `store`, then waits until every
    call's end is settled (quota release, audit record)."""
    loop = asyncio.get_running_loop()
    tails = Tails(store, loop)
    quotas = Quotas(KeyStore(store), asyncio.to_thread)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}")  # (never called)
    calls = Calls(
        scheduler_pb2_grpc.SchedulerServiceStub(channel),
        5.0,
        quotas,
        Streams(tails, lambda ids: ""),
        Audit(store, 100),
        loop,
    )
    try:
        await work(calls, quotas)
    finally:
        calls.settling.shutdown(wait=True)
        tails.stop()
        await channel.close()


def test_a_call_is_counted_and_audited_as_it_ended(redis_store):
    ends = [  # (finish reason, error, client left) -> status
        ("FINISH_REASON_EOS", None, False, "FINISH_REASON_EOS"),
        ("FINISH_REASON_LENGTH", None, True, "FINISH_REASON_LENGTH"),  # (left after its end)
        ("", "RESOURCE_EXHAUSTED", False, "RESOURCE_EXHAUSTED"),
        ("", "UNAVAILABLE", True, "CANCELLED"),  # (its client left before it)
        ("", None, True, "CANCELLED"),
        ("", None, False, "CANCELLED"),  # (cut with no status: nobody read its end)
    ]
    before = {s: requests_counted("batch", s, "canary") for *_, s in ends}

    async def work(calls: Calls, quotas: Quotas) -> None:
        for i, (finish, error, left, _) in enumerate(ends):
            call = Call(peer="ipv4:10.0.0.1:5000", protocol="http", public_id=f"r{i}")
            calls.begin(call, [])
            call.who, call.priority, call.pool, call.finish = WHO, "batch", "canary", finish
            call.prompt_tokens, call.emitted = 3, i
            calls.ended(call, error, client_left=left, reattaches=False)

    asyncio.run(gateway_calls(redis_store, work))
    records = audited(redis_store)
    assert [r["status"] for r in records] == [status for *_, status in ends]
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(len(ends))]
    first = records[0]
    assert (first["tenant"], first["key_id"], first["protocol"]) == ("acme", "k1", "http")
    assert (first["priority"], first["prompt_tokens"], first["output_tokens"]) == (
        "batch",
        "3",
        "0",
    )
    assert first["client"] == "ipv4:10.0.0.1:5000" and float(first["duration_ms"]) >= 0
    for status in {s for *_, s in ends}:
        expected = before[status] + sum(1 for *_, s in ends if s == status)
        assert requests_counted("batch", status, "canary") == expected, status


def test_a_calls_end_gives_back_its_stream_slot_and_the_tokens_it_did_not_generate(redis_store):
    async def work(calls: Calls, quotas: Quotas) -> None:
        first = Call(peer="a", who=WHO)
        calls.begin(first, [])
        await quotas.open_stream(first, new_request=True)
        await quotas.charge(first, 10, 80)  # 90 of 100 taken
        first.emitted, first.finish = 10, "FINISH_REASON_STOP"
        calls.ended(first, None, client_left=False, reattaches=True)
        await asyncio.to_thread(calls.settling.submit(lambda: None).result)  # (settled in order)
        second = Call(peer="b", who=WHO)
        await quotas.open_stream(second, new_request=True)  # its slot was the only one
        await quotas.charge(second, 10, 70)  # 70 unused came back: 80 left

    asyncio.run(gateway_calls(redis_store, work))
    assert [r["output_tokens"] for r in audited(redis_store)] == ["10"]


def test_a_call_refused_before_the_core_is_counted_and_audited_with_its_status(redis_store):
    before = requests_counted("unknown", "UNAUTHENTICATED", "none")

    async def work(calls: Calls, quotas: Quotas) -> None:
        calls.refused(Call(peer="ipv4:10.0.0.2:1"), "UNAUTHENTICATED")

    asyncio.run(gateway_calls(redis_store, work))
    (record,) = audited(redis_store)
    assert record["status"] == "UNAUTHENTICATED" and record["client"] == "ipv4:10.0.0.2:1"
    assert record["tenant"] == "" and record["output_tokens"] == "0"
    assert requests_counted("unknown", "UNAUTHENTICATED", "none") == before + 1
