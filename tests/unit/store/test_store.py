"""The request store against a real private redis-server: step writes are exactly-once by
index, ownership fences a verifier that lost its request, and an AOF restart loses nothing."""

from __future__ import annotations

import time

import pytest
import redis

from specserve.store import RequestStore, StepState, queue_key


@pytest.fixture
def store(redis_store):
    return redis_store


def running(store: RequestStore, rid: str, vid: str = "v1") -> None:
    assert store.create(rid, {"prompt_ids": [1, 2], "max_tokens": 50}, "interactive", 10)[0] == 0
    assert store.claim(rid, vid, 0)


def test_a_step_write_lands_once_whatever_is_retried(store):
    running(store, "r")
    assert store.commit_step("v1", [("r", 0, [10, 11])]) == [(0, 2)]
    assert store.commit_step("v1", [("r", 0, [10, 11])]) == [(0, 2)]  # a retry: no-op
    # A retry of a write that went through, carrying the next step's tokens as well.
    assert store.commit_step("v1", [("r", 0, [10, 11, 12, 13])]) == [(0, 4)]
    assert store.progress("r") == [10, 11, 12, 13]
    # Ahead of what Redis holds (it lost writes): nothing lands; resend from `generated`.
    assert store.commit_step("v1", [("r", 6, [16])]) == [(0, 4)]
    assert store.commit_step("v1", [("r", 4, [14, 15, 16])]) == [(0, 7)]
    firsts = [int(f["first"]) for _, f in store.r.xrange("specserve:out:r")]
    assert firsts == [0, 2, 4]
    assert store.progress("r") == [10, 11, 12, 13, 14, 15, 16]


def test_log_probabilities_land_with_their_tokens_whatever_is_retried(store):
    running(store, "r")
    lps = ["-0.5 10:-0.5", "-1 11:-1", "-2 7:-0.1", "-3 7:-0.2"]
    assert store.commit_step("v1", [("r", 0, [10, 11], lps[:2])]) == [(0, 2)]
    assert store.commit_step("v1", [("r", 0, [10, 11, 12, 13], lps)]) == [(0, 4)]
    entries = [f for _, f in store.r.xrange("specserve:out:r")]
    assert [(f["ids"], f["lp"]) for f in entries] == [
        ("10,11", ";".join(lps[:2])),
        ("12,13", ";".join(lps[2:])),  # the part past what landed, id for id
    ]
    store.commit_step("v1", [("r", 4, [14])])  # without: no field
    assert "lp" not in store.r.xrange("specserve:out:r")[-1][1]


def test_a_requeued_request_is_fenced_from_its_old_verifier(store):
    running(store, "r")
    store.commit_step("v1", [("r", 0, [7, 8, 9])])
    assert store.owned("v1") == ["r"] and store.owners() == ["v1"]
    entry = store.get("r").entry_id
    assert store.requeue("r", "v1")
    assert not store.requeue("r", "v1")  # once
    assert store.take_requeued("interactive") == [(store.get("r").entry_id, "r")]
    assert store.take_requeued("interactive") == []
    rec = store.get("r")
    assert (rec.status, rec.owner, rec.requeues, rec.generated) == ("queued", "", 1, 3)
    assert rec.entry_id != entry and store.waiting_count("interactive") == 1
    assert store.r.xrange(queue_key("interactive"), entry, entry) == []
    assert store.owned("v1") == []
    # The old verifier comes back to life: every write of it is refused.
    assert store.commit_step("v1", [("r", 3, [1])]) == [(-1, 0)]
    assert not store.finish("r", "v1", "finished", final(3), "interactive")
    # The next verifier goes on from the progress.
    assert store.claim("r", "v2", 0)
    assert store.progress("r") == [7, 8, 9]
    assert store.commit_step("v2", [("r", 3, [10])]) == [(0, 4)]
    assert store.finish("r", "v2", "finished", final(4), "interactive")
    assert store.get("r").status == "finished" and store.owned("v2") == []
    assert store.r.xpending(queue_key("interactive"), "placement")["pending"] == 0


def test_a_request_with_tokens_is_claimed_only_by_their_model_version(store):
    assert store.create("r", {"prompt_ids": [1], "max_tokens": 9}, "interactive", 10)[0] == 0
    assert store.claim("r", "v1", 0, version="m:1", pool="canary") == 1
    assert store.requeue("r", "v1")  # before any token: any version may take it
    assert store.claim("r", "v2", 0, version="m:2", pool="stable") == 1
    assert store.commit_step("v2", [("r", 0, [5, 6])], version="m:2") == [(0, 2)]
    assert store.requeue("r", "v2")
    rec = store.get("r")
    assert (rec.version, rec.pool, rec.generated) == ("m:2", "stable", 2)
    assert store.claim("r", "v1", 0, version="m:1", pool="canary") == 2  # refused
    assert store.get("r").status == "queued"
    assert store.claim("r", "v3", 0, version="m:2", pool="canary") == 1  # same version
    assert store.commit_step("v3", [("r", 2, [7])], version="m:2") == [(0, 3)]
    entries = store.r.xrange("specserve:out:r")
    assert {fields["v"] for _, fields in entries} == {"m:2"}


def final(tokens: int) -> dict:
    return {"finish_reason": "FINISH_REASON_LENGTH", "usage": {"completion_tokens": tokens}}


def test_entries_a_dead_consumer_read_are_reclaimed(store):
    running(store, "r")  # claimed by a verifier, never read by this consumer
    store.create("q", {"prompt_ids": [1], "max_tokens": 5}, "interactive", 10)
    assert [rid for _, rid in store.read_queue("interactive", "dead-scheduler", 10)] == ["r", "q"]
    assert store.reclaim("interactive", "live-scheduler", min_idle_ms=60_000) == []
    time.sleep(0.05)
    reclaimed = store.reclaim("interactive", "live-scheduler", min_idle_ms=10)
    assert [rid for _, rid in reclaimed] == ["r", "q"]
    assert store.pending_entries("interactive", "dead-scheduler") == []


def test_an_aof_restart_of_redis_loses_no_written_step(redis_server, store):
    running(store, "r")
    for i in range(5):
        store.commit_step("v1", [("r", i, [i])])
    redis_server.kill_redis()
    assert not store.ping()
    time.sleep(0.5)  # Redis is away for a moment
    redis_server.start_redis()
    # The client reconnects by itself; the scripts are loaded again.
    for i in range(5, 10):
        assert store.commit_step("v1", [("r", i, [i])]) == [(0, i + 1)]
    assert store.progress("r") == list(range(10))
    assert store.ping()


def test_a_store_call_fails_cleanly_when_redis_stays_away(redis_server):
    store = RequestStore.from_url(redis_server.redis_url, retries=3)  # (services: 10, ~6 s)
    redis_server.kill_redis()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        store.get("r")
    assert time.monotonic() - started < 5  # retried with backoff, then given up


def test_a_request_pauses_while_its_client_is_too_far_behind(store):
    running(store, "r")
    # Nobody streams it through a gateway (no read cursor): it never pauses.
    assert store.commit_step("v1", [("r", 0, [1, 2, 3, 4])], max_unread=2) == [(0, 4)]
    store.mark_read("r", 1)  # the gateway has sent the first token
    assert store.commit_step("v1", [("r", 4, [])], max_unread=2) == [(StepState.PAUSED, 4)]
    assert store.commit_step("v1", [("r", 4, [])], max_unread=0) == [(0, 4)]  # (no bound)
    store.mark_read("r", 2)  # the client reads on
    assert store.commit_step("v1", [("r", 4, [])], max_unread=2) == [(0, 4)]
    store.r.hset("specserve:req:r", "cancel", 1)  # a cancel wins
    assert store.commit_step("v1", [("r", 4, [5, 6])], max_unread=2) == [(StepState.CANCELLED, 6)]
    store.mark_read("gone", 3)  # no record of a request that is gone is made
    assert store.get("gone") is None and not store.r.exists("specserve:req:gone")


def test_running_requests_and_their_tenants(store):
    for rid, tenant in (("a1", "a"), ("a2", "a"), ("b1", "b"), ("x", "")):
        spec = {"prompt_ids": [1], "max_tokens": 5, "tenant": tenant} if tenant else {}
        store.create(rid, spec or {"prompt_ids": [1], "max_tokens": 5}, "interactive", 10)
    store.claim("a1", "v1", 0)
    store.claim("b1", "v2", 0)
    store.claim("x", "v2", 0)
    assert store.running_on(["v1", "v2", "v3"]) == {"a1", "b1", "x"}
    assert store.running_on([]) == set()
    assert store.tenants(["a1", "a2", "x", "nope"]) == {"a1": "a", "a2": "a", "x": "", "nope": ""}
