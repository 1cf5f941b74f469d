"""The verifier's drafter pool: a drafter that comes back gets a trial at once, not after its
breaker's cooldown; and a Redis outage logs one line as it starts and one as it ends."""

from __future__ import annotations

import logging

import grpc
import pytest
import redis

from conftest import cluster_config
from helpers import generate, request, wait_until
from specserve.common.outage import OutageLog
from specserve.store import RequestStore
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import generation_pb2_grpc
from specserve.verifier.drafter_pool import DrafterPool

A, B = "10.0.0.1:50054", "10.0.0.2:50054"


class Registry:
    """What discovery finds: address -> start time; raises while `down`."""

    def __init__(self, entries: dict[str, str]):
        self.entries = dict(entries)
        self.down = False

    def __call__(self) -> dict[str, str]:
        if self.down:
            raise redis.ConnectionError("Error 111 connecting to redis")
        return dict(self.entries)


@pytest.fixture
def clock():
    now = [1000.0]
    return now


def pool_of(registry: Registry, clock, static=(A,)) -> DrafterPool:
    pool = DrafterPool(
        list(static), registry, (2, 10.0), refresh_seconds=1.0, clock=lambda: clock[0]
    )
    pool.refresh()
    return pool


def fail(pool: DrafterPool, address: str, times: int = 2) -> None:
    for _ in range(times):
        pool.breakers[address].failure()


def tick(pool: DrafterPool, clock, seconds: float = 1.0) -> None:
    clock[0] += seconds
    pool.refresh()


def test_a_restarted_drafter_gets_a_trial_at_the_next_refresh(clock):
    registry = Registry({A: "100", B: "100"})
    pool = pool_of(registry, clock)
    fail(pool, A)
    assert pool.assign("s1") == B  # A's breaker is open: its sequences go elsewhere
    tick(pool, clock)
    assert not pool.breakers[A].allow()  # same process: the cooldown holds
    registry.entries[A] = "5000"  # a new process at the same address
    tick(pool, clock)
    assert pool.breakers[A].allow()  # 1 s after it registered, not 10
    fail(pool, A, times=1)  # the trial failed: open again for the full cooldown
    assert not pool.breakers[A].allow()
    tick(pool, clock)
    assert not pool.breakers[A].allow()


def test_a_drafter_registered_again_after_its_entry_expired_gets_a_trial(clock):
    registry = Registry({A: "100"})
    pool = pool_of(registry, clock)
    fail(pool, A)
    del registry.entries[A]  # its heartbeats stopped; A stays: it is configured
    tick(pool, clock)
    assert A in pool.clients and not pool.breakers[A].allow()
    registry.entries[A] = "100"  # back (the same start time: a partition that healed)
    tick(pool, clock)
    assert pool.breakers[A].allow()


def test_a_slow_drafter_that_never_left_waits_out_the_cooldown(clock):
    registry = Registry({A: "100"})
    pool = pool_of(registry, clock)
    fail(pool, A)
    for _ in range(9):
        tick(pool, clock)
        assert not pool.breakers[A].allow()
    tick(pool, clock)
    assert pool.breakers[A].allow()


def test_discovery_during_a_redis_outage_keeps_the_drafters_and_logs_twice(clock, caplog):
    registry = Registry({A: "100", B: "100"})
    pool = pool_of(registry, clock, static=())
    registry.down = True
    with caplog.at_level(logging.INFO, logger="specserve.verifier.drafter_pool"):
        for _ in range(5):
            tick(pool, clock)
        assert set(pool.clients) == {A, B}
        registry.down = False
        tick(pool, clock)
        tick(pool, clock)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["redis unreachable; retrying", "redis back after 5 failed tries"]
    assert all(r.levelno == logging.WARNING and not r.exc_info for r in caplog.records)


def test_outage_log_counts_each_burst(caplog):
    outage = OutageLog(logging.getLogger("test.outage"), "heartbeat")
    with caplog.at_level(logging.INFO, logger="test.outage"):
        outage.succeeded()
        for _ in range(3):
            outage.failed(redis.ConnectionError("refused"))
        outage.succeeded()
        outage.succeeded()
        outage.failed(redis.TimeoutError("timed out"))
        assert outage.down
        outage.succeeded()
    assert [r.getMessage() for r in caplog.records] == [
        "redis unreachable; retrying",
        "redis back after 3 failed tries",
        "redis unreachable; retrying",
        "redis back after 1 failed try",
    ]
    assert caplog.records[0].error == "ConnectionError: refused"
    assert caplog.records[1].failed_tries == 3 and caplog.records[1].__dict__["in"] == "heartbeat"


@pytest.mark.cluster
def test_a_drafter_restarted_at_its_address_drafts_again_at_once(
    tmp_path, tiny_model_dir, tiny_draft_dir, tokenizer
):
    """Through the cluster: with a 10-minute cooldown, only the drafter's return can close
    its breaker before the next request ends."""
    config = cluster_config(
        tiny_model_dir,
        verifier={
            "speculative_decoding": True,
            "verification_tree_size": 4,
            "speculation_policy": "fixed",
            "breaker_failures": 1,
            "breaker_cooldown_seconds": 600,
        },
    )
    config["drafter"].update(draft_model_path=str(tiny_draft_dir))
    cluster = LocalCluster(config, tmp_path).start(timeout=180)
    try:
        store = RequestStore.from_url(cluster.redis_url)
        ids = tokenizer("def fibonacci(n):").input_ids
        with grpc.insecure_channel(cluster.procs["gateway"].address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            port = cluster.procs["drafter"].port
            (first,) = store.live("drafter")
            cluster.kill("drafter")
            down = generate(stub, request(prompt_ids=ids, max_tokens=20))
            assert down.final.speculation.fallback_steps > 0  # its breaker opened

            cluster.start_service("drafter", port=port)
            before = [(first["id"], first["started_ms"])]
            wait_until(
                lambda: (
                    [(d["id"], d["started_ms"]) for d in store.live("drafter")] not in ([], before)
                ),
                "the drafter registered again",
            )
            back = generate(stub, request(prompt_ids=ids, max_tokens=20))
        stats = back.final.speculation
        assert stats.fallback_steps <= 1 and stats.drafted_tokens > 0, stats
    finally:
        cluster.stop()


def test_a_tenants_sequences_go_to_its_home_drafter_within_the_slack(clock):
    """The drafter holding a tenant's completed outputs drafts its new sequences, on every
    verifier alike, until it holds TENANT_SLACK more than the least loaded."""
    from specserve.verifier.drafter_pool import TENANT_SLACK

    registry = Registry({A: "100", B: "100"})
    pool, other = pool_of(registry, clock), pool_of(registry, clock)
    homes = {t: pool.assign(f"{t}-0", t) for t in ("acme", "globex", "initech", "umbrella")}
    assert set(homes.values()) == {A, B}  # tenants spread over the drafters
    assert all(other.assign(f"{t}-x", t) == home for t, home in homes.items())
    for t in homes:
        pool.release(f"{t}-0")
    home = homes["acme"]
    placed = [pool.assign(f"acme-{i}", "acme") for i in range(TENANT_SLACK + 3)]
    assert placed[: TENANT_SLACK + 1] == [home] * (TENANT_SLACK + 1)
    assert placed[TENANT_SLACK + 1] != home  # beyond the slack: the least loaded
