"""Admission (slots, KV blocks, the prefix cache) and placement policy: pure logic, no
services."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.common import prefix
from specserve.common.capacity import admission_blocks, kv_fit_problem, kv_need
from specserve.engine.kv_cache import KVPool
from specserve.scheduler.placement import (
    VerifierLoad,
    Want,
    choose_verifier,
    class_order,
    tenant_cap,
    under_cap,
)
from specserve.verifier.admission import Admission, Refused, cgroup_free_bytes


def admission(blocks: int = 64, batch_size: int = 8, reserved: int = 0, **kw) -> Admission:
    pool = KVPool(1, 1, 2, torch.float32, "cpu", block_size=4, blocks=blocks, fixed=True)
    return Admission(pool, batch_size, reserved, **kw)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_the_rule_is_in_blocks_and_the_worst_case_only_decides_what_can_ever_run():
    assert kv_need(100, 50, 4096) == 150 and kv_need(4000, 500, 4096) == 4096
    assert admission_blocks(15, 0, 4) == 4  # 15 tokens + the first generated one
    assert admission_blocks(16, 0, 4) == 5 and admission_blocks(16, 3, 4) == 2
    assert kv_fit_problem(10, 6, 16, 4096, 4) is None
    assert "max_tokens (7)" in kv_fit_problem(10, 7, 16, 4096, 4)  # 17 tokens: 5 blocks


def test_slots_and_the_batch_class_share():
    adm = admission(batch_size=3, reserved=1)
    adm.admit("b1", "batch", tokens(10))
    adm.admit("b2", "batch", tokens(10, 100))
    with pytest.raises(Refused, match="batch-class"):
        adm.admit("b3", "batch", tokens(10, 200))
    adm.admit("i1", "interactive", tokens(10, 300))  # the reserved slot
    with pytest.raises(Refused, match="batch is full"):
        adm.admit("i2", "interactive", tokens(10, 400))
    load = adm.load()
    assert (load["running"], load["batch_running"], load["kv_used"]) == (3, 2, 9)
    adm.release("b1")
    adm.admit("i2", "interactive", tokens(10, 400))
    assert adm.admit("i2", "interactive", tokens(10, 400)) is None  # admitted already


def test_admission_takes_the_prompts_blocks_only_and_keeps_the_watermark():
    adm = admission(blocks=10, watermark_blocks=2)
    first = adm.admit("a", "interactive", tokens(11))  # 12 tokens: 3 blocks, whatever max_tokens
    assert len(first.kv.table) == 3 and adm.load()["kv_free"] == 5
    with pytest.raises(Refused, match="needs 6 KV blocks of 4 tokens, 5 are free"):
        adm.admit("b", "interactive", tokens(21, 100))
    adm.admit("b", "interactive", tokens(19, 100))  # 5 blocks: the watermark is left
    assert adm.pool.available == 2
    first.kv.free()
    adm.release("a")
    assert adm.load()["kv_free"] == 3


def test_the_watermark_does_not_keep_a_lone_request_out():
    adm = admission(blocks=4, watermark_blocks=2)
    assert len(adm.admit("a", "interactive", tokens(15)).kv.table) == 4


def test_a_prompt_reuses_the_cached_blocks_of_its_prefix_without_a_session():
    adm = admission(blocks=16)
    system = tokens(9)  # two full blocks and one token
    a = adm.admit("a", "interactive", system + [50, 51, 52])
    a.kv.length = 12
    a.kv.seal(system + [50, 51, 52])  # (as the engine does after each step)
    assert adm.pool.cached == 3
    b = adm.admit("b", "interactive", system + [60, 61])
    assert b.cached_tokens == 8 and b.kv.table[:2] == a.kv.table[:2]  # shared, not copied
    assert b.kv.length == 8 and b.kv.table[2] != a.kv.table[2]
    a.kv.free()
    b.kv.free()
    assert adm.pool.available == 16 and adm.pool.cached == 3  # unreferenced, still cached


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    pool = KVPool(1, 1, 2, torch.float32, "cpu", block_size=4, blocks=4, fixed=True)
    old, new = SequenceFor(pool, tokens(5)), SequenceFor(pool, tokens(5, 50))
    old.free()
    new.free()  # released last: evicted last
    assert pool.cached == 2
    taken = pool.take(3)  # two free blocks, then the least recently released cached one
    assert pool.cached == 1 and pool.lookup(prefix.block_hashes(tokens(4), 4, pool.root)) == []
    assert len(pool.lookup(prefix.block_hashes(tokens(4, 50), 4, pool.root))) == 1
    pool.release(taken)


def test_a_prefix_keeps_its_first_blocks_longest():
    """A sequence releases its blocks last first: eviction takes a prefix's tail before the
    blocks the rest of it is found through."""
    pool = KVPool(1, 1, 2, torch.float32, "cpu", block_size=4, blocks=3, fixed=True)
    SequenceFor(pool, tokens(12)).free()
    pool.release(pool.take(1))
    assert len(pool.lookup(prefix.block_hashes(tokens(12), 4, pool.root))) == 2


def test_admission_waits_while_preempted_sequences_wait_and_says_so_in_its_load():
    adm = admission(blocks=16, watermark_blocks=2)
    assert adm.load()["kv_free"] == 16  # nothing runs: no watermark
    adm.admit("a", "interactive", tokens(3))
    assert adm.load()["kv_free"] == 13
    adm.resuming = 1
    assert adm.load()["kv_free"] == 0
    with pytest.raises(Refused, match="preempted sequences wait"):
        adm.admit("b", "interactive", tokens(3, 10))


def SequenceFor(pool: KVPool, ids: list[int]):
    """A sequence holding `ids`, its full blocks sealed."""
    from specserve.engine.kv_cache import SequenceKV

    kv = SequenceKV(pool)
    kv.reserve(len(ids))
    kv.length = len(ids)
    kv.seal(ids)
    return kv


def load(vid, running=0, capacity=4, batch_running=0, kv_free=250, kv_budget=1000, prefixes=()):
    return VerifierLoad(
        vid,
        vid,
        capacity,
        running,
        capacity - 1,
        batch_running,
        kv_budget,
        kv_free,
        block_size=4,
        max_seq_len=4096,
        prefixes=frozenset(prefixes),
    )


def test_placement_prefers_the_longest_cached_prefix_then_the_session_then_load():
    prompt = tokens(41)  # 10 full blocks before the last token
    hashes = [prefix.short(h) for h in prefix.block_hashes(prompt[:40], 4, prefix.root(""))]
    loads = [
        load("a", running=2, kv_free=100),
        load("b", running=1, kv_free=225, prefixes=hashes[:3]),
        load("c", running=3, kv_free=50, prefixes=hashes[:6]),
    ]
    want = Want("interactive", len(prompt), 100, "a", prompt_ids=prompt)
    assert choose_verifier(loads, want).verifier_id == "c"  # 6 blocks cached
    assert loads[2].cached_blocks(want) == 6 and loads[2].need(want) == 11  # (see need)
    assert choose_verifier(loads[:2], want).verifier_id == "b"
    other = Want("interactive", 41, 100, "a", prompt_ids=tokens(41, 7))  # no cached prefix
    assert choose_verifier(loads, other).verifier_id == "a"  # its session's verifier
    assert choose_verifier(loads, Want("interactive", 41, 100)).verifier_id == "b"  # most free
    assert choose_verifier(loads, Want("interactive", 999, 1)) is None  # 250 blocks: no room


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


def test_the_cpu_kv_budget_follows_the_containers_memory_limit(tmp_path):
    """A pod sizes its KV by its own limit less its working set, not by the node's RAM."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")  # 8 GiB
    (v2 / "memory.current").write_text(str(3 << 30))
    (v2 / "memory.stat").write_text(f"anon {2 << 30}\ninactive_file {1 << 30}\n")
    assert cgroup_free_bytes(v2) == (8 << 30) - (2 << 30)  # page cache is reclaimable
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_free_bytes(v2) is None  # no limit: the RAM available decides
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(4 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(1 << 30))
    (v1 / "memory.stat").write_text("total_inactive_file 0\n")
    assert cgroup_free_bytes(tmp_path / "v1") == 3 << 30
    (v1 / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "unlimited"
    assert cgroup_free_bytes(tmp_path / "v1") is None
    assert cgroup_free_bytes(tmp_path / "none") is None
