"""The request state on a real Redis Cluster: 3 masters with a replica each, on loopback.

Every script touches one slot (a request's keys share its shard's hash tag with that shard's
queues and sets); the shards spread over the masters; a write that must be on a replica is not
acknowledged until it is; a master that dies mid-load hands over to its replica and no request
is lost."""

from __future__ import annotations

import threading
from collections import Counter

import grpc
import pytest
import yaml
from redis_cluster import RedisClusterNodes

from conftest import cluster_config
from helpers import request, wait_until
from specserve.common.settings import Tier
from specserve.gateway.keys import KeyStore
from specserve.store import CLUSTER_SHARDS, NotReplicated, RequestStore, StepState
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import common_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

# Redis Cluster nodes, and services on them, are processes of their own.
pytestmark = pytest.mark.cluster


@pytest.fixture
def nodes(tmp_path):
    nodes = RedisClusterNodes(tmp_path / "redis-cluster").start()
    yield nodes
    nodes.stop()


def spec(rid: str, n: int = 4) -> dict:
    return {"request_id": rid, "prompt_ids": [1, 2, 3], "max_tokens": n}


def test_every_transition_runs_on_redis_cluster_with_the_shards_on_every_master(nodes):
    store = RequestStore.from_url(nodes.url, cluster=True)
    store.ensure_queues()
    at = store.layout
    rids = [f"r{i}" for i in range(64)]
    assert {at.shard_of(rid) for rid in rids} == set(range(CLUSTER_SHARDS))
    masters = {nodes.master_of(at.req(rid)) for rid in rids}
    assert len(masters) == 3, f"the shards sit on {len(masters)} of 3 masters"
    keyslot = nodes.node(nodes.live_ports()[0]).cluster
    for rid in rids[:8]:  # a request's keys share a slot with its shard's queue and sets
        shard = at.shard_of(rid)
        slots = {keyslot("keyslot", key) for key in (at.req(rid), at.out(rid))}
        slots |= {keyslot("keyslot", at.queue(c, shard)) for c in ("interactive", "batch")}
        slots |= {keyslot("keyslot", at.owned("v", shard)), keyslot("keyslot", at.owners(shard))}
        assert len(slots) == 1, (rid, slots)

    for rid in rids:
        assert store.create(rid, spec(rid), "interactive", 1000)[0] == 0
    assert store.create(rids[0], spec(rids[0]), "interactive", 1000)[0] == 1  # idempotent
    assert store.waiting_count("interactive") == 64
    entries = store.read_queue("interactive", "placer", 100)
    assert sorted(rid for _, rid in entries) == sorted(rids)
    assert store.pending_entries("interactive", "placer", 100) == entries  # oldest first

    for rid in rids:
        assert store.claim(rid, "v1", 1, incarnation="i1") == 1
    assert store.waiting_count("interactive") == 0
    assert store.owned("v1") == sorted(rids) and store.owners() == ["v1"]
    steps = store.commit_step("v1", [(rid, 0, [7, 8]) for rid in rids], incarnation="i1")
    assert steps == [(StepState.OK, 2)] * 64  # one pipeline per master, scripts and all
    repeat = store.commit_step("v1", [(rid, 0, [7, 8]) for rid in rids], incarnation="i1")
    assert repeat == [(StepState.OK, 2)] * 64 and store.progress(rids[5]) == [7, 8]

    half = rids[:32]
    assert all(store.requeue(rid, "v1", incarnation="i1") for rid in half)
    requeued = store.take_requeued("interactive")
    assert sorted(rid for _, rid in requeued) == sorted(half)
    assert store.waiting_count("interactive") == 32
    assert {c.request_id for c in store.claims(["v1"])} == set(rids[32:])
    for rid in half[:16]:
        assert store.cancel(rid, {"status": "cancelled"}) == (1, "")
    for rid in half[16:]:
        assert store.end_queued(rid, {"status": "expired"}, "expired")
    for rid in rids[32:]:
        final = {"usage": {"completion_tokens": 2}}
        assert store.finish(rid, "v1", "finished", final, "interactive", "sess", "i1")
    assert store.waiting_count("interactive") == 0 and store.owned("v1") == []
    statuses = Counter(store.get(rid).status for rid in rids)
    assert statuses == {"finished": 32, "cancelled": 16, "expired": 16}
    assert store.session_owner("sess") == "v1"
    assert store.r.xlen(at.queue("interactive", 0)) == 0  # every entry acked and deleted


def test_a_write_no_replica_holds_is_not_acknowledged_and_a_failover_keeps_what_was(nodes):
    """With redis_wait_replicas 1 a request is acknowledged only once its master's replica
    holds it: one whose replica is stopped is refused (UNAVAILABLE from Submit), and a request
    that was acknowledged survives its master's death."""
    store = RequestStore.from_url(nodes.url, cluster=True, wait_replicas=1, wait_timeout_ms=2000)
    store.ensure_queues()
    master = nodes.master_of(store.layout.req("kept"))
    assert store.create("kept", spec("kept"), "batch", 100) == (0, 0)  # on the replica now
    replica = nodes.replica_of(master)
    late = next(
        f"late{i}" for i in range(1000) if nodes.master_of(store.layout.req(f"late{i}")) == master
    )
    nodes.pause(replica)
    try:
        with pytest.raises(NotReplicated, match="0 of 1 replicas"):
            store.create(late, spec(late), "batch", 100)
    finally:
        nodes.resume(replica)
    # Retried (as Submit's callers do) once the replica is back: it was written, and now
    # it is acknowledged.
    assert wait_until(lambda: _retried(store.create, late, spec(late), "batch", 100), "ack")[0] == 1

    nodes.kill(master)
    wait_until(lambda: nodes.roles().get(replica) == "master", "the replica takes over", 30)
    nodes.wait_healthy()
    for rid in ("kept", late):
        rec = wait_until(lambda r=rid: _get(store, r), f"{rid} read after the failover", 30)
        assert rec.status == "queued" and rec.spec["request_id"] == rid
    assert store.waiting_count("batch") == 2


def test_a_slot_migration_under_writes_makes_them_retry_and_loses_nothing(nodes):
    """The slot of one shard moves to another master, a few keys at a time, while requests
    of that shard are created, claimed and written step after step: a write that meets the
    move fails as Redis being away (the verifier writes it again with its next step, as
    here) or follows it; none raises anything else, and every token ends up written once."""
    store = RequestStore.from_url(nodes.url, cluster=True)
    store.ensure_queues()
    at = store.layout
    rids = [r for r in (f"m{i}" for i in range(400)) if at.shard_of(r) == 3][:12]
    slot = nodes.node(nodes.live_ports()[0]).cluster("keyslot", at.req(rids[0]))
    source = nodes.master_of(at.req(rids[0]))
    target = next(p for p, role in nodes.roles().items() if role == "master" and p != source)
    for rid in rids:
        assert store.create(rid, spec(rid, 200), "interactive", 1000)[0] == 0
        assert store.claim(rid, "v1", 1, incarnation="i1") == 1
    written = dict.fromkeys(rids, 0)
    retried, unexpected, rounds = [0], [], [0]
    done = threading.Event()

    def steps() -> None:  # a verifier's decode loop: a failed write is sent again next step
        while not done.is_set() or min(written.values()) < 120:
            batch = [(rid, written[rid], [written[rid] % 97 + 1]) for rid in rids]
            try:
                results = store.commit_step("v1", batch, incarnation="i1")
            except Exception as e:  # commit_step reports failures per request, never raises
                unexpected.append(repr(e))
                return
            for rid, result in zip(rids, results, strict=True):
                if result is None:
                    retried[0] += 1
                else:
                    written[rid] = result[1]
            rounds[0] += 1

    writer = threading.Thread(target=steps)
    writer.start()
    wait_until(lambda: min(written.values()) >= 20, "steps written before the move")

    def two_more_steps() -> None:  # the move is spread over the writes: some meet it
        seen = rounds[0]
        wait_until(lambda: rounds[0] >= seen + 2, "two steps during the move")

    moved = nodes.migrate_slot(slot, source, target, batch=6, between=two_more_steps)
    done.set()
    writer.join(timeout=120)
    assert not writer.is_alive() and unexpected == []
    assert moved >= 2 * len(rids)  # req and out keys of each, with the shard's queue and sets
    assert nodes.master_of(at.req(rids[0])) == target
    for rid in rids:
        assert store.progress(rid) == [k % 97 + 1 for k in range(written[rid])], rid
        assert store.get(rid).generated == written[rid]
    assert store.owned("v1") == sorted(rids)
    print(f"slot {slot}: {moved} keys moved; {retried[0]} writes failed and were written again")


def _retried(write, *args):
    try:
        return write(*args)
    except NotReplicated:
        return None


def _get(store: RequestStore, rid: str):
    try:
        return store.get(rid)
    except Exception:  # the client relearns the slots after the failover
        return None


@pytest.fixture
def on_cluster(tmp_path, nodes, tiny_model_dir):
    """The services on the Redis Cluster, writes acknowledged once on a replica; API keys on;
    the one verifier in the canary pool."""
    config = cluster_config(
        tiny_model_dir,
        common={"redis_cluster": True, "redis_wait_replicas": 1, "redis_wait_timeout_ms": 3000},
        gateway={"auth": "api_key"},
        verifier={"pool": "canary"},
    )
    cluster = LocalCluster(config, tmp_path / "services", redis_url=nodes.url)
    cluster.start(timeout=180)
    yield cluster
    cluster.stop()


def test_the_cluster_serves_on_redis_cluster_through_a_master_failover(on_cluster, nodes):
    settings = yaml.safe_load(on_cluster.config_path.read_text())
    assert settings["common"]["redis_cluster"] is True
    store = RequestStore.from_url(nodes.url, cluster=True)
    keys = KeyStore(store.r)
    key = keys.create("acme", "standard", Tier(requests_per_minute=1000, concurrent_streams=8))
    capped = keys.create("tiny", "standard", Tier(requests_per_minute=1))
    stub = generation_pb2_grpc.GenerationServiceStub(
        grpc.insecure_channel(on_cluster.procs["gateway"].address)
    )
    auth = (("authorization", f"Bearer {key}"),)

    # Rollout: the only verifier is a canary; new requests wait for the stable pool until
    # the canary is given their share.
    store.set_canary_share(1.0)
    first = stub.Generate(
        request([5, 6, 7], max_tokens=8, request_id="first"), metadata=auth, timeout=120
    )
    chunks = list(first)
    assert chunks[-1].final.pool == "canary" and sum(len(c.token_ids) for c in chunks) == 8

    # Quotas hold on the cluster: one request a minute.
    limited = (("authorization", f"Bearer {capped}"),)
    q1, q2 = (request([1, 2], max_tokens=2, request_id=rid) for rid in ("q1", "q2"))
    list(stub.Generate(q1, metadata=limited, timeout=120))
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(q2, metadata=limited, timeout=120))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    # The reference: each prompt alone, before any failure (greedy: the same tokens again).
    prompts = {f"load{i}": [11 + i, 12, 13 + i] for i in range(4)}  # the batch is 4
    reference = {}
    for rid, prompt in prompts.items():
        ref = request(prompt, max_tokens=600, request_id=f"ref-{rid}")
        chunks = stub.Generate(ref, metadata=auth, timeout=240)
        reference[rid] = [t for c in chunks for t in c.token_ids]

    results: dict[str, list[int]] = {}
    errors: list[str] = []

    def run(rid: str) -> None:
        try:
            chunks = list(
                stub.Generate(
                    request(prompts[rid], max_tokens=600, request_id=rid),
                    metadata=auth,
                    timeout=240,
                )
            )
            results[rid] = [t for c in chunks for t in c.token_ids]
        except grpc.RpcError as e:
            errors.append(f"{rid}: {e.code()} {e.details()}")

    threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    # Mid-load: kill the master of a request that is streaming (its replica takes over
    # after the node timeout).
    running = wait_until(
        lambda: next(
            (
                r
                for r in prompts
                if _generated(store, f"acme:{r}") >= 10 and _status(store, f"acme:{r}") == "running"
            ),
            None,
        ),
        "a request streams",
        120,
    )
    victim = nodes.master_of(store.layout.req(f"acme:{running}"))  # (stored under its tenant)
    masters_before = {p for p, role in nodes.roles().items() if role == "master"}
    nodes.kill(victim)
    replica = wait_until(
        lambda: next(
            (
                p
                for p, role in nodes.roles().items()
                if role == "master" and p not in masters_before
            ),
            None,
        ),
        "a replica takes over",
        30,
    )
    # The shard has no replica now, so its creations and ends wait (NotReplicated: retried)
    # until the dead master comes back, as its replica.
    nodes.restart(victim)
    wait_until(lambda: nodes.replica_of(replica) == victim, "the old master is a replica", 60)
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert errors == []
    assert results == reference  # nothing lost, nothing repeated, nothing else
    assert all(_status(store, f"acme:{rid}") == "finished" for rid in prompts)

    # Submit is refused (UNAVAILABLE, to retry), not acknowledged, while the write cannot
    # reach a replica of its shard's master.
    rid = next(  # on a master that still has its replica
        f"unreplicated{i}"
        for i in range(1000)
        if nodes.replica_of(nodes.master_of(store.layout.req(f"unreplicated{i}")))
    )
    replica = nodes.replica_of(nodes.master_of(store.layout.req(rid)))
    scheduler = scheduler_pb2_grpc.SchedulerServiceStub(
        grpc.insecure_channel(on_cluster.procs["scheduler"].address)
    )
    submit = scheduler_pb2.SubmitRequest(
        request_id=rid, max_tokens=2, priority=common_pb2.PRIORITY_CLASS_INTERACTIVE
    )
    submit.prompt_ids.extend([1, 2])
    nodes.pause(replica)
    try:
        with pytest.raises(grpc.RpcError) as unavailable:
            scheduler.Submit(submit, timeout=30)
    finally:
        nodes.resume(replica)
    assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "replicas acknowledged" in unavailable.value.details()
    assert scheduler.Submit(submit, timeout=30).existing  # written, acknowledged now


def _generated(store: RequestStore, rid: str) -> int:
    try:
        rec = store.get(rid)
    except Exception:
        return 0
    return rec.generated if rec else 0


def _status(store: RequestStore, rid: str) -> str:
    try:
        rec = store.get(rid)
    except Exception:
        return ""
    return rec.status if rec else ""
