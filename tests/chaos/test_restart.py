"""A verifier that restarts at once under the same id (SIGKILL, then the same port again, as a
StatefulSet container restarts in place) strands nothing: the scheduler sees the new
incarnation and requeues what the old one ran, with its progress. And a request Redis says a
live verifier runs, which that verifier does not run, is requeued within seconds whatever the
cause. Every stream completes with the undisturbed greedy output, each index exactly once."""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
from test_chaos import MAX_TOKENS, PROMPTS, assert_nothing_lost, report

from conftest import cluster_config
from helpers import Client, wait_until
from specserve.store import ENDED, GROUP, RequestStore, now_ms, queue_key, queued_key
from specserve.store import req_key as request_key
from specserve.tools.local_cluster import LocalCluster
from specserve.verifier.reference import hf_greedy

pytestmark = pytest.mark.cluster  # every test here runs a cluster

REQUESTS = 6  # 4 batch slots: 4 run when the kill comes, 2 wait
KINDS = 3  # distinct prompts (each twice): the reference outputs are slow to compute


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    """One verifier (batch 4). Its registry entry is never gone long enough for the
    dead-verifier path (grace 600 s): only the new incarnation can bring its requests back."""
    config = cluster_config(
        tiny_model_dir,
        scheduler={"dead_verifier_grace_seconds": 600, "orphan_grace_seconds": 1.0},
        verifier={"speculative_decoding": True, "draft_timeout_seconds": 1.0},
    )
    cluster = LocalCluster(config, tmp_path_factory.mktemp("restart"))
    cluster.start(timeout=180)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def store(cluster):
    return RequestStore.from_url(cluster.redis_url)


@pytest.fixture(scope="module")
def expected(tiny_model, tokenizer):
    return {p: hf_greedy(tiny_model, tokenizer(p).input_ids, MAX_TOKENS) for p in PROMPTS[:KINDS]}


def log_lines(cluster: LocalCluster, key: str) -> list[dict]:
    text = cluster.procs[key].log_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def requeue_lines(cluster: LocalCluster, reason: str) -> dict[str, dict]:
    """The scheduler's "requeued" log lines with `reason`, by request id."""
    return {
        line["request_id"]: line
        for line in log_lines(cluster, "scheduler")
        if line["msg"] == "requeued" and line.get("reason") == reason
    }


def seconds(ts: str) -> float:
    return datetime.datetime.fromisoformat(ts).timestamp()


def test_a_verifier_restarted_at_once_under_its_id_strands_nothing(
    cluster, store, expected, tokenizer
):
    verifier = cluster.procs["verifier"]
    vid, port = verifier.address, verifier.port
    before = store.r.hget(f"specserve:verifier:{vid}", "incarnation")
    address = cluster.procs["gateway"].address
    clients = [
        Client(f"restart-{i}", tokenizer(PROMPTS[i % KINDS]).input_ids, MAX_TOKENS)
        for i in range(REQUESTS)
    ]
    threads = [threading.Thread(target=c.run, args=(address,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    wait_until(lambda: sum(c.received >= 8 for c in clients) >= 4, "4 streams under way", 60)
    stranded = store.owned(vid)
    in_flight = [c for c in clients if c.received and c.final is None]
    killed_at = time.monotonic()
    cluster.kill("verifier")  # SIGKILL
    cluster.start_service("verifier", verifier_env(cluster), port=port, instance="verifier")
    cluster.wait_ready("verifier", 120)
    after = store.r.hget(f"specserve:verifier:{vid}", "incarnation")
    for t in threads:
        t.join(timeout=300)
    row = report("verifier-restart", clients, in_flight, killed_at, store, expected, tokenizer)
    assert_nothing_lost(row)
    assert before and after and after != before
    assert len(stranded) == 4
    requeued = requeue_lines(cluster, "earlier_incarnation")
    assert set(stranded) <= set(requeued)  # one line each, naming the reason
    assert all(requeued[rid]["verifier"] == vid for rid in stranded)
    assert all(store.get(rid).requeues >= 1 for rid in stranded)
    assert store.owned(vid) == []
    # What the earlier incarnation left goes first on the new one, before what was queued.
    lines = log_lines(cluster, "scheduler")
    last_requeue = max(i for i, line in enumerate(lines) if line["msg"] == "requeued")
    queued = {c.rid for c in clients} - set(stranded)
    placed = [line["request_id"] for line in lines[last_requeue:] if line["msg"] == "placed"]
    assert sorted(placed[: len(stranded)]) == sorted(stranded) and queued <= set(placed)
    ready = [line for line in log_lines(cluster, "verifier") if line["msg"] == "verifier ready"]
    delay = seconds(lines[last_requeue]["ts"]) - seconds(ready[-1]["ts"])
    print(f"requeued {delay:.2f} s after the new incarnation said it was ready")


def verifier_env(cluster: LocalCluster) -> dict[str, str]:
    return {"SPECSERVE_VERIFIER_DRAFTER_ADDRESSES": f'["{cluster.procs["drafter"].address}"]'}


def ended(store: RequestStore, rid: str):
    rec = store.get(rid)
    return rec if rec.status in ENDED else None


def claim_behind_its_back(store: RequestStore, rid: str, prompt: list[int], vid: str) -> None:
    """Creates a request already claimed by the live verifier's incarnation, in one
    transaction (the scheduler cannot place it in between), without the verifier knowing:
    a request it does not run."""
    incarnation = store.r.hget(f"specserve:verifier:{vid}", "incarnation")
    spec = {"request_id": rid, "prompt_ids": prompt, "max_tokens": 40}
    pipe = store.r.pipeline(transaction=True)
    store._create(
        keys=[request_key(rid), queue_key("interactive"), queued_key("interactive")],
        args=[json.dumps(spec), GROUP, 100, "interactive", now_ms(), rid, ""],  # (no fingerprint)
        client=pipe,
    )
    at = store.layout
    store._claim(
        keys=[request_key(rid), at.owned(vid), at.owners(), *at.per_class(at.queued, 0)],
        args=[vid, now_ms(), rid, "", "stable", incarnation],
        client=pipe,
    )
    assert pipe.execute() == [[0, 0], 1]


def test_a_request_its_verifier_does_not_run_is_requeued_and_completes(
    cluster, store, tiny_model, tokenizer
):
    vid = cluster.procs["verifier"].address
    prompt = tokenizer(PROMPTS[0]).input_ids
    started = time.monotonic()
    claim_behind_its_back(store, "not-running-here", prompt, vid)
    assert store.get("not-running-here").status == "running"
    line = wait_until(
        lambda: requeue_lines(cluster, "not_running").get("not-running-here"), "the requeue", 15
    )
    found_s = time.monotonic() - started
    print(f"\nnot running on its verifier: requeued after {found_s:.1f} s")
    assert line["verifier"] == vid and "does not run it" in line["detail"]
    rec = wait_until(
        lambda: (r := store.get("not-running-here")).status in ENDED and r, "the end", 60
    )
    assert (rec.status, rec.requeues) == ("finished", 1)
    assert store.progress("not-running-here") == hf_greedy(tiny_model, prompt, 40)
