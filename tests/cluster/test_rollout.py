"""Canary rollout: two verifier pools (stable: the tiny model; canary: the same model with
perturbed weights, so another version) behind one scheduler. The canary gets the share of new
requests that Redis holds; every stream is of one model version, through a rollback during
traffic and through a canary verifier that drains mid-request."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid

import grpc
import pytest

from conftest import F32_KIND, cluster_config
from helpers import request, wait_until
from specserve.common.pools import CANARY, STABLE, bucket, choose_pool, pool_shares
from specserve.common.settings import SchedulerSettings
from specserve.scheduler.placement import VerifierLoad, Want, choose_verifier
from specserve.scheduler.server import Placer, VerifierClients
from specserve.store import RequestStore
from specserve.tools import rollout
from specserve.tools.local_cluster import LocalCluster
from specserve.v1 import generation_pb2, generation_pb2_grpc, scheduler_pb2_grpc


# --- pool choice (pure) ---------------------------------------------------------------------
def test_the_canary_gets_its_share_of_request_ids():
    n, share = 20_000, 0.1
    canary = sum(choose_pool(uuid.uuid4().hex, share, {STABLE, CANARY}) == CANARY for _ in range(n))
    sigma = (n * share * (1 - share)) ** 0.5
    assert abs(canary - n * share) < 4 * sigma  # 4 sigma: fails about once in 15,000 runs


def test_pool_choice_at_the_ends_and_with_a_pool_down():
    ids = [uuid.uuid4().hex for _ in range(200)]
    both = {STABLE, CANARY}
    assert {choose_pool(i, 0.0, both) for i in ids} == {STABLE}  # rolled back
    assert {choose_pool(i, 1.0, both) for i in ids} == {CANARY}  # promoted
    assert {choose_pool(i, 0.5, {STABLE}) for i in ids} == {STABLE}  # canary down: stable
    assert {choose_pool(i, 0.0, {CANARY}) for i in ids} == {STABLE}  # rolled back: waits
    assert all(choose_pool(i, 0.3, both) == choose_pool(i, 0.3, both) for i in ids)
    assert pool_shares(both, 0.25) == {STABLE: 0.75, CANARY: 0.25}
    assert pool_shares({STABLE}, 0.25) == {STABLE: 1.0}
    assert pool_shares({CANARY}, 0.0) == {CANARY: 0.0}


def test_a_pinned_request_is_placed_only_on_its_pool_or_version():
    loads = [
        VerifierLoad(
            "s", "a:1", 4, 0, 4, 0, 1000, 1000, max_seq_len=100, pool=STABLE, version="m:1"
        ),
        VerifierLoad(
            "c", "a:2", 4, 0, 4, 0, 1000, 100, max_seq_len=100, pool=CANARY, version="m:2"
        ),
    ]
    # Unpinned, the one with more free KV wins; pinned, only the pool or version asked for.
    assert choose_verifier(loads, Want("interactive", 10, 10)).verifier_id == "s"
    assert choose_verifier(loads, Want("interactive", 10, 10, pool=CANARY)).verifier_id == "c"
    assert choose_verifier(loads, Want("interactive", 10, 10, version="m:2")).verifier_id == "c"
    assert choose_verifier(loads, Want("interactive", 10, 10, version="m:3")) is None


# --- the placement loop against a real Redis (no verifier process) ------------------------
@pytest.fixture
def bare_store(redis_store):
    return redis_store


def handed_back(store: RequestStore, rid: str, version: str) -> None:
    """A request that generated a token on `version`, then went back to its queue."""
    assert store.create(rid, {"prompt_ids": [1, 2], "max_tokens": 9}, "interactive", 10)[0] == 0
    assert store.claim(rid, "gone", 0, version=version, pool=CANARY) == 1
    assert store.commit_step("gone", [(rid, 0, [5])], version=version) == [(0, 1)]
    assert store.requeue(rid, "gone")


def register(store: RequestStore, vid: str, version: str) -> None:
    row = {"address": "127.0.0.1:9", "capacity": 4, "batch_capacity": 3, "kv_budget": 1000}
    row |= {"kv_free": 1000, "block_size": 1}
    store.heartbeat(vid, row | {"max_seq_len": 100, "version": version, "pool": STABLE}, 30)


def test_a_request_whose_version_is_gone_waits_aside_then_fails_with_why(bare_store):
    placer = Placer(
        SchedulerSettings(version_wait_seconds=1.0), bare_store, VerifierClients(), "test"
    )
    handed_back(bare_store, "r", "m:1")
    register(bare_store, "v2", "m:2")  # free, but another version
    placer.take_requeued()
    assert not placer.place_some()  # nothing placed, and no Admit tried on m:2
    assert set(placer.parked) == {"r"} and not placer.waiting["interactive"]
    placer.unpark()  # well within version_wait_seconds: it waits on
    assert set(placer.parked) == {"r"} and bare_store.get("r").status == "queued"

    def failed() -> bool:
        placer.unpark()
        return bare_store.get("r").status == "failed"

    wait_until(failed, "the parked request failed after version_wait_seconds", timeout=10)
    assert not placer.parked
    final = json.loads(bare_store.r.xrevrange("specserve:out:r", count=1)[0][1]["final"])
    assert "m:1" in final["error"] and "no longer served" in final["error"]
    assert final["usage"]["completion_tokens"] == 1
    # A version that comes back in time takes its requests back, ahead of their class.
    handed_back(bare_store, "p", "m:1")
    placer.take_requeued()
    placer.place_some()
    assert "p" in placer.parked
    register(bare_store, "v3", "m:1")
    placer.unpark()
    assert placer.waiting["interactive"][0][1] == "p" and not placer.parked


def test_a_verifier_drafts_only_with_the_drafters_of_its_pool(bare_store):
    for address, pool in (("d1:1", STABLE), ("d2:1", CANARY), ("d3:1", STABLE)):
        bare_store.heartbeat(address, {"address": address, "pool": pool}, 30, kind="drafter")
    bare_store.heartbeat("d4:1", {"address": "d4:1"}, 30, kind="drafter")  # no pool: stable
    assert sorted(bare_store.drafters(STABLE)) == ["d1:1", "d3:1", "d4:1"]
    assert bare_store.drafters(CANARY) == ["d2:1"]


# --- the cluster ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def canary_dir(tiny_draft_dir):
    """The canary's weights: the tiny model's, perturbed (its greedy outputs differ)."""
    return tiny_draft_dir


CANARY_KEY = "verifier-canary"


def start_canary(cluster: LocalCluster, model_dir) -> None:
    env = {
        "SPECSERVE_VERIFIER_POOL": CANARY,
        "SPECSERVE_VERIFIER_MODEL__PATH": str(model_dir),
        "SPECSERVE_VERIFIER_DRAIN_SECONDS": "0",  # a SIGTERM hands back what runs at once
    }
    cluster.start_service("verifier", env, instance=CANARY_KEY)
    cluster.wait_ready(CANARY_KEY, 120)


@pytest.fixture(scope="module")
def pools(tmp_path_factory, tiny_model_dir, canary_dir):
    config = cluster_config(tiny_model_dir, scheduler={"dead_verifier_grace_seconds": 0.5})
    cluster = LocalCluster(config, tmp_path_factory.mktemp("rollout"))
    cluster.start(timeout=180, services=("scheduler", "verifier", "gateway"))
    try:
        start_canary(cluster, canary_dir)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def store(pools):
    return RequestStore.from_url(pools.redis_url)


@pytest.fixture(scope="module")
def stub(pools):
    with grpc.insecure_channel(pools.procs["gateway"].address) as channel:
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def versions_by_pool(stub) -> dict[str, str]:
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    return {p.pool: p.model_versions[0] for p in info.pools}


def ids_in(pool: str, share: float, n: int) -> list[str]:
    """Request ids that the share sends to `pool` (the gateway stores an anonymous caller's
    ids as they are)."""
    out = []
    while len(out) < n:
        rid = f"rollout-{uuid.uuid4().hex[:10]}"
        if (bucket(rid) < share) == (pool == CANARY):
            out.append(rid)
    return out


class Stream:
    """One Generate call on a thread: its chunks, and the error it ended with, if any."""

    def __init__(self, stub, rid: str, prompt_ids: list[int], max_tokens: int):
        self.rid, self.chunks, self.error = rid, [], ""
        req = request(prompt_ids=prompt_ids, max_tokens=max_tokens)
        req.request_id = rid
        self.thread = threading.Thread(target=self._run, args=(stub, req))
        self.thread.start()

    def _run(self, stub, req) -> None:
        try:
            for chunk in stub.Generate(req, timeout=180):
                self.chunks.append(chunk)
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"

    def result(self):
        self.thread.join(timeout=200)
        assert not self.error, f"{self.rid}: {self.error}"
        assert self.chunks and self.chunks[-1].HasField("final"), f"{self.rid}: no final chunk"
        return self

    @property
    def final(self):
        return self.chunks[-1].final

    def versions(self) -> set[str]:
        return {c.model_version for c in self.chunks if c.token_ids or c.HasField("final")}

    def assert_one_version(self, versions: dict[str, str]) -> None:
        """Every chunk, the final included, names the version of the pool that finished it,
        and the token indices follow on without gap or repeat."""
        assert self.versions() == {versions[self.final.pool]}, self.rid
        index = 0
        for chunk in self.chunks:
            assert chunk.first_index == index, self.rid
            index += len(chunk.token_ids)
        assert index == self.final.usage.completion_tokens


@pytest.mark.cluster
def test_each_pool_reports_its_version(stub, store):
    store.set_canary_share(0.0)
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    pools = {p.pool: p for p in info.pools}
    assert set(pools) == {STABLE, CANARY}
    assert pools[STABLE].model_versions != pools[CANARY].model_versions  # other weights
    name = info.name.rsplit("/", 1)[-1]
    assert pools[STABLE].model_versions == [f"{name}:{info.sha256[:12]}:float32:{F32_KIND}"]
    assert (pools[STABLE].share, pools[CANARY].share) == (1.0, 0.0)
    report = rollout.status(store)
    assert report["pools"][CANARY]["versions"] == list(pools[CANARY].model_versions)


@pytest.mark.cluster
def test_a_canary_split_over_many_requests(stub, store, tokenizer):
    share, n = 0.3, 60
    store.set_canary_share(share)
    versions = versions_by_pool(stub)
    prompt = tokenizer("def add(a, b):").input_ids
    streams = []
    for _ in range(n):  # eight at a time
        rid = f"split-{uuid.uuid4().hex[:10]}"
        streams.append(Stream(stub, rid, prompt, 3))
        if len(streams) % 8 == 0:
            for s in streams[-8:]:
                s.result()
    for s in streams:
        s.result().assert_one_version(versions)
        # Each request ran in the pool its id falls in: the split is exact per request.
        assert s.final.pool == (CANARY if bucket(s.rid) < share else STABLE), s.rid
    canary = sum(s.final.pool == CANARY for s in streams)
    sigma = (n * share * (1 - share)) ** 0.5
    assert abs(canary - n * share) < 4 * sigma, canary


@pytest.mark.cluster
def test_probes_compare_the_pools_greedy_outputs(pools, store):
    from specserve.engine import models

    store.set_canary_share(0.0)  # probes run in both pools whatever the share
    tokenizer = models.load_tokenizer(pools.config["gateway"]["model"]["path"])
    with grpc.insecure_channel(pools.procs["scheduler"].address) as channel:
        results = rollout.probe(
            store, scheduler_pb2_grpc.SchedulerServiceStub(channel), tokenizer.encode, max_tokens=8
        )
    assert len(results) == len(rollout.PROBES)
    assert all(len(r.outputs[STABLE]) == len(r.outputs[CANARY]) == 8 for r in results)
    assert all(r.versions[STABLE] != r.versions[CANARY] for r in results)
    summary = rollout.agreement(results)
    assert summary["exact"] < 1.0  # perturbed weights: some greedy output differs
    assert summary["exact"] <= summary["prefix"] <= 1.0


def rollout_cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specserve.tools.cli", "--config", str(cluster.config_path)]
        + ["rollout", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.cluster
def test_the_rollout_command_sets_shows_and_rolls_back_the_share(pools, store):
    run = rollout_cli(pools, "canary", "0.25")
    assert run.returncode == 0, run.stderr
    assert store.rollout()["canary_share"] == 0.25
    run = rollout_cli(pools, "status")
    assert run.returncode == 0 and "canary share 25%" in run.stdout
    assert {line.split()[0] for line in run.stdout.splitlines()[2:]} == {STABLE, CANARY}
    report = json.loads(rollout_cli(pools, "status", "--json").stdout)
    assert report["pools"][CANARY]["share"] == 0.25
    run = rollout_cli(pools, "rollback", "--wait", "30")
    assert run.returncode == 0 and "can be removed" in run.stdout, run.stdout
    assert store.rollout() | {"updated_ms": 0} == {
        "canary_share": 0.0,
        "previous_share": 0.25,
        "updated_ms": 0,
    }
    run = rollout_cli(pools, "canary", "1.5")
    assert run.returncode == 2 and "within 0 and 1" in run.stderr


@pytest.mark.cluster
def test_the_probe_command_fails_below_the_agreement_asked_for(pools, tmp_path):
    out = tmp_path / "probe.json"
    args = ("--scheduler", pools.procs["scheduler"].address, "--max-tokens", "4")
    run = rollout_cli(pools, "probe", *args, "--out", str(out), "--min-agreement", "1.0")
    assert run.returncode == 1, run.stdout + run.stderr  # the canary's weights differ
    assert "below 100%" in run.stderr
    report = json.loads(out.read_text())
    assert report["summary"]["probes"] == len(rollout.PROBES) > 0
    assert report["summary"]["exact"] < 1.0
    assert rollout_cli(pools, "probe", *args, "--min-agreement", "0").returncode == 0


@pytest.mark.cluster
def test_a_probe_without_a_canary_pool_says_so(tiny_cluster):
    run = rollout_cli(tiny_cluster, "probe", "--scheduler", tiny_cluster.procs["scheduler"].address)
    assert run.returncode == 1 and "no live verifier in the canary pool" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.cluster
def test_rollback_during_traffic_fails_nothing_and_mixes_no_stream(stub, store, tokenizer):
    store.set_canary_share(0.5)
    versions = versions_by_pool(stub)
    prompt = tokenizer("class Queue:\n    def __init__(self):").input_ids
    before = [
        Stream(stub, rid, prompt, 400) for rid in ids_in(CANARY, 0.5, 4) + ids_in(STABLE, 0.5, 4)
    ]
    deadline = time.monotonic() + 60
    while not all(len(s.chunks) > 1 for s in before) and time.monotonic() < deadline:
        time.sleep(0.05)
    on_canary = [s for s in before if versions[CANARY] in s.versions()]
    assert on_canary, "no request streamed from the canary before the rollback"
    lines = []
    assert rollout.rollback(store, wait_seconds=120, out=lines.append) == 0  # emptied in time
    assert "runs nothing" in lines[-1]
    # New requests, even those whose ids fall in the canary's share, go to stable.
    after = [Stream(stub, rid, prompt, 20) for rid in ids_in(CANARY, 0.5, 4)]
    for s in before + after:
        s.result().assert_one_version(versions)
    assert all(s.final.pool == CANARY for s in on_canary)  # finished where they started
    assert all(s.final.pool == STABLE for s in after)
    assert rollout.canary_running(store) == 0


@pytest.mark.cluster
def test_a_request_handed_back_by_a_canary_waits_for_its_version(pools, stub, store, canary_dir):
    """The canary drains mid-request: the request goes back to the queue with its tokens;
    the stable verifier is free but serves another version, so the request waits for a
    canary verifier and finishes there."""
    store.set_canary_share(1.0)
    versions = versions_by_pool(stub)
    [rid] = ids_in(CANARY, 1.0, 1)
    stream = Stream(stub, rid, [1, 2, 3], 1000)
    deadline = time.monotonic() + 60
    while len(stream.chunks) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream.chunks, "no token before the drain"
    assert pools.kill(CANARY_KEY, signal.SIGTERM) == 0  # drained: handed back what ran on
    store.set_canary_share(0.0)  # and rolled back: new requests go to stable meanwhile
    other = Stream(stub, f"rollout-{uuid.uuid4().hex[:10]}", [4, 5, 6], 8).result()
    assert other.final.pool == STABLE  # the parked request does not hold its class back
    rec = store.get(rid)
    assert rec.status == "queued" and rec.generated > 0 and rec.version == versions[CANARY]
    start_canary(pools, canary_dir)
    stream.result().assert_one_version(versions)
    assert stream.final.pool == CANARY  # it started there: the share does not move it
    assert stream.final.usage.completion_tokens == 1000
