"""Fair under abuse, on a real cluster with API keys for two tenants: one tenant holding 50
streams it never reads neither takes every batch slot nor generates for nobody."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import redis

from conftest import cluster_config
from helpers import request
from specserve.common.settings import DEFAULT_TIERS, Tier
from specserve.common.store import req_key
from specserve.gateway.keys import KeyStore
from specserve.local_cluster import LocalCluster
from specserve.v1 import generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc

BATCH = 4  # slots; a tenant may hold half of them (tenant_slot_share 0.5, the default)
MAX_UNREAD = 16
PAUSE_TIMEOUT = 3.0
HOARDED = 50
FEW_STEPS = 10
PAUSED = "paused: its client is not reading"  # the verifier's log line
# A client that stops reading: its transport takes ~1 KiB and then no more. (A default gRPC
# client's receive window grows to megabytes first; see docs/architecture.md.)
STALLED_CLIENT = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    config = cluster_config(
        tiny_model_dir,
        gateway={"auth": "api_key", "max_workers": 96, "max_concurrent_rpcs": 96},
        verifier={
            "batch_size": BATCH,
            "max_unread_tokens": MAX_UNREAD,
            "pause_timeout_seconds": PAUSE_TIMEOUT,
        },
    )
    cluster = LocalCluster(config, tmp_path_factory.mktemp("fairness"))
    cluster.start(timeout=180, services=("scheduler", "verifier", "gateway"))
    yield cluster
    cluster.stop()


def auth(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


def wait_for(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def median(runs: list[tuple[float, int]]) -> tuple[float, int]:
    return tuple(sorted(values)[len(values) // 2] for values in zip(*runs, strict=True))


def first_token(gateway, key: str, verifier) -> tuple[float, int]:
    """A normal client's request: (seconds, verifier steps) from its call to its first
    token. It reads to the end."""
    steps = verifier.Status(verifier_pb2.VerifierStatusRequest(), timeout=5).steps
    started = time.monotonic()
    call = gateway.Generate(
        request(prompt="def f():", max_tokens=4), timeout=60, metadata=auth(key)
    )
    ttft = None
    for chunk in call:
        if ttft is None and chunk.token_ids:
            ttft = time.monotonic() - started
            ttft_steps = verifier.Status(verifier_pb2.VerifierStatusRequest(), timeout=5).steps
    assert chunk.final.usage.completion_tokens == 4
    return ttft, ttft_steps - steps


def test_a_tenant_hoarding_unread_streams_neither_blocks_another_nor_runs_on(cluster):
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    keys = KeyStore(r)
    hoarder = keys.create(
        "hoarder", "standard", Tier(concurrent_streams=64, requests_per_minute=600)
    )
    bystander = keys.create("bystander", "standard", DEFAULT_TIERS["standard"])
    verifier = verifier_pb2_grpc.VerifierStub(
        grpc.insecure_channel(cluster.procs["verifier"].address)
    )
    gateway = generation_pb2_grpc.GenerationStub(
        grpc.insecure_channel(cluster.procs["gateway"].address)
    )

    def status():
        return verifier.Status(verifier_pb2.VerifierStatusRequest(), timeout=5)

    def hoarders_running() -> list[str]:
        ids = [rid for rid in status().request_ids if rid.startswith("hoarder:")]
        assert len(ids) <= BATCH // 2, f"the hoarder holds {len(ids)} of {BATCH} slots"
        return ids

    idle = [first_token(gateway, bystander, verifier) for _ in range(3)]
    stalled = grpc.insecure_channel(cluster.procs["gateway"].address, options=STALLED_CLIENT)
    hoarding = [
        generation_pb2_grpc.GenerationStub(stalled).Generate(
            request(prompt=f"def hoard_{i}():", max_tokens=1000, request_id=f"h{i}"),
            timeout=120,
            metadata=auth(hoarder),
        )
        for i in range(HOARDED)
    ]  # opened, never read
    try:
        first = wait_for(
            "the hoarder at its cap", lambda: len(ids := hoarders_running()) == 2 and ids
        )
        busy = [first_token(gateway, bystander, verifier) for _ in range(3)]
        wait_for(
            "the hoarder's streams to pause",
            lambda: cluster.procs["verifier"].log_text().count(PAUSED) >= len(first),
        )
        sent = {}
        for rid in first:  # paused a bounded way past what their client was sent
            generated, sent[rid] = map(int, r.hmget(req_key(rid), "generated", "read"))
            assert generated - sent[rid] <= MAX_UNREAD + 1, (generated, sent[rid])
        wait_for(
            "the paused streams to end",
            lambda: all(r.hget(req_key(rid), "status") == "cancelled" for rid in first),
            timeout=PAUSE_TIMEOUT + 30,
        )
        finals = [json.loads(r.hget(req_key(rid), "final")) for rid in first]
        for rid, final in zip(first, finals, strict=True):  # not generated to the end
            assert "read no output for 3s" in final["error"]
            assert final["usage"]["completion_tokens"] <= sent[rid] + MAX_UNREAD + 1 < 1000
        wait_for(  # their slots went to the hoarder's next requests
            "the freed slots reused", lambda: set(hoarders_running()) - set(first)
        )
        # The bystander's first token came within a few of the hoarder's steps of an idle
        # cluster's: in steps counted by the verifier, and in time.
        step_s = (
            max(f["timings"]["decode_ms"] / (f["usage"]["completion_tokens"] - 1) for f in finals)
            / 1e3
        )
        idle_s, idle_steps = median(idle)
        busy_s, busy_steps = max(s for s, _ in busy), max(n for _, n in busy)  # the worst
        print(
            f"first token: idle {idle_s * 1e3:.0f} ms / {idle_steps} steps, next to the hoarder "
            f"at worst {busy_s * 1e3:.0f} ms / {busy_steps} steps; a step {step_s * 1e3:.1f} ms"
        )
        assert busy_steps <= idle_steps + FEW_STEPS
        assert busy_s <= idle_s + FEW_STEPS * step_s
    finally:
        for call in hoarding:
            call.cancel()
        stalled.close()
