"""Admission (slots, KV budget, prefix cache) and placement policy: pure logic, no services."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.common.capacity import kv_need
from specserve.common.kv_cache import KVPool, SequenceKV
from specserve.scheduler.placement import (
    VerifierLoad,
    Want,
    choose_verifier,
    class_order,
    tenant_cap,
    under_cap,
)
from specserve.verifier.admission import Admission, CachedPrefix, Refused


def prefix(tokens: int) -> CachedPrefix:
    kv = SequenceKV(KVPool(1, 1, 2, torch.float32, "cpu", block_size=1))
    kv.reserve(tokens)
    kv.length = tokens
    return CachedPrefix(list(range(tokens)), kv)


def test_kv_need_is_capped_by_max_seq_len():
    assert kv_need(100, 50, 4096) == 150
    assert kv_need(4000, 500, 4096) == 4096


def test_slots_and_the_batch_class_share():
    adm = Admission(kv_budget=10_000, batch_size=3, interactive_reserved_slots=1)
    adm.admit("b1", "batch", 10)
    adm.admit("b2", "batch", 10)
    with pytest.raises(Refused, match="batch-class"):
        adm.admit("b3", "batch", 10)
    adm.admit("i1", "interactive", 10)  # the reserved slot
    with pytest.raises(Refused, match="batch is full"):
        adm.admit("i2", "interactive", 10)
    assert adm.load() == {"running": 3, "batch_running": 2, "kv_reserved": 30, "kv_cached": 0}
    adm.release("b1")
    adm.admit("i2", "interactive", 10)
    assert adm.admit("i2", "interactive", 10) is None  # admitted already: nothing reserved
    assert adm.load()["kv_reserved"] == 30


def test_the_kv_budget_is_never_overcommitted():
    adm = Admission(kv_budget=100, batch_size=8, interactive_reserved_slots=0)
    adm.admit("a", "interactive", 60)
    with pytest.raises(Refused, match="needs 41 KV tokens, 40 are free"):
        adm.admit("b", "interactive", 41)
    adm.admit("b", "interactive", 40)
    assert adm.load()["kv_reserved"] == 100


def test_cached_prefixes_use_unreserved_budget_and_are_evicted_oldest_first():
    adm = Admission(kv_budget=100, batch_size=8, interactive_reserved_slots=0)
    adm.admit("a", "interactive", 30)
    assert adm.release("a", "s1", prefix(30))
    adm.admit("b", "interactive", 30)
    assert adm.release("b", "s2", prefix(30))
    assert adm.load()["kv_cached"] == 60
    adm.admit("c", "interactive", 50)  # needs 50 of the 40 left unless s1 goes
    assert adm.load() == {"running": 1, "batch_running": 0, "kv_reserved": 50, "kv_cached": 30}
    assert adm.admit("d", "interactive", 10, session_id="s1").prefix is None  # evicted
    assert adm.admit("e", "interactive", 10, session_id="s2").prefix is not None
    assert not adm.release("x", "s3", prefix(500))  # larger than the free budget: not kept


def test_a_session_turn_takes_its_prefix_over_with_its_buffer():
    adm = Admission(kv_budget=100, batch_size=8, interactive_reserved_slots=0)
    adm.admit("a", "interactive", 40)
    adm.release("a", "s", prefix(40))
    grant = adm.admit("b", "interactive", 20, session_id="s")
    assert grant.prefix is not None and grant.tokens == 40  # its buffer is 40 long
    assert adm.load()["kv_cached"] == 0 and adm.load()["kv_reserved"] == 40
    with pytest.raises(Refused):
        adm.admit("c", "interactive", 61)
    adm.release("b", "s", grant.prefix)  # refused admissions put the prefix back like this
    assert adm.admit("d", "interactive", 10, session_id="s").prefix is grant.prefix


def load(vid, running=0, capacity=4, batch_running=0, kv_reserved=0, kv_budget=1000):
    return VerifierLoad(
        vid, vid, capacity, running, capacity - 1, batch_running, kv_budget, kv_reserved, 4096
    )


def test_placement_prefers_the_sessions_verifier_then_the_least_loaded():
    loads = [load("a", running=2, kv_reserved=600), load("b", running=1, kv_reserved=100)]
    assert choose_verifier(loads, Want("interactive", 100, 100)).verifier_id == "b"
    assert choose_verifier(loads, Want("interactive", 100, 100, "a")).verifier_id == "a"
    # The session's verifier has no room for it: least loaded wins.
    assert choose_verifier(loads, Want("interactive", 300, 200, "a")).verifier_id == "b"
    assert choose_verifier(loads, Want("interactive", 900, 200)) is None


def test_placement_respects_slots_and_the_batch_share():
    full = load("a", running=4)
    batch_full = load("b", running=3, batch_running=3)
    assert choose_verifier([full, batch_full], Want("batch", 10, 10)) is None
    assert choose_verifier([full, batch_full], Want("interactive", 10, 10)) is batch_full


def test_batch_goes_first_after_a_burst_of_interactive_placements():
    assert class_order(0, 4, batch_waiting=True)[0] == "interactive"
    assert class_order(4, 4, batch_waiting=True)[0] == "batch"
    assert class_order(9, 4, batch_waiting=False)[0] == "interactive"


def test_a_tenant_holds_at_most_its_share_of_the_slots():
    loads = [load("a", capacity=8), load("b", capacity=4)]
    assert tenant_cap(loads, 0.5) == 6 and tenant_cap(loads, 1.0) == 12
    assert tenant_cap([load("a", capacity=1)], 0.5) == 1  # at least one slot
    held = Counter({"greedy": 6, "modest": 1})
    assert not under_cap("greedy", held, 6)
    assert under_cap("modest", held, 6) and under_cap("new", held, 6)
    assert under_cap("", held, 0)  # no tenant (auth off): never capped
