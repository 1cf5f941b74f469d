"""Orphans against a real private redis-server: a claim is fenced by its verifier's incarnation,
and a running request its verifier does not run (restarted under the same id, or not listed)
is found, by the scheduler's rule and by `specserve doctor`."""

from __future__ import annotations

import pytest

from specserve.store import RequestStore, now_ms
from specserve.store.ownership import EARLIER_INCARNATION, NOT_RUNNING, OrphanFinder
from specserve.tools.doctor import orphans_finding

GRACE_MS = 1000


@pytest.fixture
def store(redis_store):
    return redis_store


def running(store: RequestStore, rid: str, incarnation: str, admitted_ms: int = 0) -> None:
    assert store.create(rid, {"prompt_ids": [1, 2], "max_tokens": 50}, "interactive", 10)[0] == 0
    assert store.claim(rid, "v1", admitted_ms, incarnation=incarnation) == 1


def register(store: RequestStore, incarnation: str, request_ids: list[str], listed_ms: int):
    entry = {"address": "127.0.0.1:1", "incarnation": incarnation, "listed_ms": listed_ms}
    store.heartbeat("v1", entry | {"request_ids": ",".join(request_ids)}, ttl_seconds=30)


def final(tokens: int) -> dict:
    return {"finish_reason": "FINISH_REASON_LENGTH", "usage": {"completion_tokens": tokens}}


def look(store: RequestStore, finder: OrphanFinder) -> dict[str, str]:
    """request id -> reason, of the orphans seen now (claims read before the registry)."""
    claims = store.claims(store.owners())
    live = {v["id"]: v for v in store.live_verifiers()}
    return {o.claim.request_id: o.reason for o in finder.look(claims, live)}


def test_an_earlier_incarnation_can_no_longer_write_and_only_its_claim_is_requeued(store):
    running(store, "old", "a", admitted_ms=5)
    assert store.commit_step("v1", [("old", 0, [7, 8])], incarnation="a") == [(0, 2)]
    running(store, "new", "b")  # the same verifier id, started again
    # The old process, were it still alive, writes nothing more.
    assert store.commit_step("v1", [("old", 2, [9])], incarnation="b") == [(-1, 0)]
    assert store.commit_step("v1", [("new", 0, [1])], incarnation="a") == [(-1, 0)]
    assert not store.finish("new", "v1", "finished", final(0), "interactive", incarnation="a")
    # A requeue names the claim: not the new incarnation's, nor one made at another time.
    assert not store.requeue("new", "v1", incarnation="a")
    assert not store.requeue("old", "v1", incarnation="a", admitted_ms=6)
    assert store.owned("v1") == ["new", "old"]
    assert store.requeue("old", "v1", incarnation="a", admitted_ms=5)
    assert store.owned("v1") == ["new"]
    rec = store.get("old")
    assert (rec.status, rec.requeues, rec.generated, rec.incarnation) == ("queued", 1, 2, "a")
    assert store.progress("old") == [7, 8]  # the next verifier goes on from here
    assert store.finish("new", "v1", "finished", final(1), "interactive", incarnation="b")


def test_a_claim_of_an_earlier_incarnation_is_an_orphan_at_once(store):
    running(store, "old", "a")
    running(store, "new", "b", admitted_ms=now_ms())
    register(store, "b", ["new"], now_ms())
    finder = OrphanFinder(GRACE_MS)
    assert look(store, finder) == {"old": EARLIER_INCARNATION}
    store.deregister("v1")  # a verifier with no live entry: the dead-verifier path, not this
    assert look(store, finder) == {}


def test_a_request_missing_from_two_lists_of_its_verifier_is_an_orphan(store):
    t = now_ms()
    running(store, "lost", "b", admitted_ms=t - 10_000)  # claimed long ago, not listed
    running(store, "listed", "b", admitted_ms=t - 10_000)
    running(store, "joining", "b", admitted_ms=t - GRACE_MS // 2)  # being admitted now
    finder = OrphanFinder(GRACE_MS)
    register(store, "b", ["listed"], t)
    assert look(store, finder) == {} and finder.suspects == 1  # once: perhaps moving
    assert look(store, finder) == {} and finder.suspects == 1  # the same list again
    register(store, "b", ["listed", "joining"], t + 500)
    assert look(store, finder) == {"lost": NOT_RUNNING}
    # Listed again (it was only moving): no longer a suspect.
    finder = OrphanFinder(GRACE_MS)
    register(store, "b", ["listed", "joining"], t + 1000)
    look(store, finder)
    register(store, "b", ["listed", "joining", "lost"], t + 1500)
    assert look(store, finder) == {} and finder.suspects == 0
    # A verifier that does not list its requests (an older one) has none found this way.
    store.heartbeat("v1", {"address": "127.0.0.1:1", "incarnation": "b"}, ttl_seconds=30)
    store.r.hdel("specserve:verifier:v1", "listed_ms", "request_ids")
    assert look(store, OrphanFinder(GRACE_MS)) == {}


def test_doctor_names_the_orphans(store):
    running(store, "old", "a")
    running(store, "fine", "b", admitted_ms=now_ms())
    register(store, "b", ["fine"], now_ms())
    found = orphans_finding(store, grace_seconds=1.0, period_seconds=0.01)
    assert found.level == "fail" and found.check == "orphaned requests"
    assert "old (claimed by incarnation a of verifier v1, which restarted as b)" in found.detail
    assert "fine" not in found.detail
    assert store.requeue("old", "v1", incarnation="a")
    found = orphans_finding(store, grace_seconds=1.0, period_seconds=0.01)
    assert (found.level, found.detail) == ("ok", "none (1 running)")
