"""The block pool: blocks taken as positions are written, shared by prefix, given back, never
leaked; a fixed pool refuses instead of growing."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import DEVICE
from specserve.engine.flat_model import FlatModel, Segment
from specserve.engine.kv_cache import KVPool, OutOfBlocks, SequenceKV


def pool(blocks: int = 4, block_size: int = 4) -> KVPool:
    return KVPool(2, 1, 2, torch.float32, DEVICE, block_size=block_size, blocks=blocks)


def test_blocks_are_taken_as_positions_need_them_and_given_back():
    p = pool()
    kv = SequenceKV(p)
    kv.reserve(5)
    assert len(kv.table) == 2 and kv.capacity == 8
    kv.reserve(8)
    assert len(kv.table) == 2  # still fits
    kv.free()
    assert sorted(p.free_blocks) == [0, 1, 2, 3]


def test_a_dropped_sequence_gives_its_blocks_back():
    p = pool()
    kv = SequenceKV(p)
    kv.reserve(16)
    assert p.free_blocks == []
    del kv
    assert p.take(4) and p.available == 0  # (given back at the pool's next call)


def test_the_pool_grows_and_keeps_what_it_holds():
    p = pool(blocks=1)
    kv = SequenceKV(p)
    kv.reserve(4)
    with torch.inference_mode():
        p.keys[:, kv.slots(0, 4)] = 7.0
    kv.reserve(13)  # 3 more blocks than the pool had
    assert p.blocks >= 4
    assert bool((p.keys[:, kv.slots(0, 4)] == 7.0).all())


def test_slots_follow_the_block_table():
    assert pool(blocks=8).slots([5, 2], 2, 7).tolist() == [22, 23, 8, 9, 10]


def test_random_sequences_leak_no_blocks(tiny_model):
    """Sequences come and go, grow, roll back and keep tree paths: when all are gone, every
    block is free again."""
    flat = FlatModel(tiny_model, kv_tokens=64, block_size=4)
    total = flat.pool.blocks
    rng = random.Random(0)
    live: list = []
    for _ in range(40):
        if live and rng.random() < 0.3:
            live.pop(rng.randrange(len(live))).free()
            continue
        if not live or rng.random() < 0.4:
            live.append(flat.new_kv())
        segs = [Segment(kv, [rng.randrange(100) for _ in range(rng.randint(1, 9))]) for kv in live]
        flat.forward(segs)
        for kv in live:
            kv.truncate(max(0, kv.length - rng.randint(0, 2)))
    for kv in live:
        kv.free()
    assert len(flat.pool.free_blocks) == flat.pool.blocks >= total


def test_a_fixed_pool_refuses_and_takes_nothing():
    p = KVPool(2, 1, 2, torch.float32, DEVICE, block_size=4, blocks=3, fixed=True)
    kv = SequenceKV(p)
    kv.reserve(8)
    with pytest.raises(OutOfBlocks, match="2 KV blocks asked for, 1 available"):
        kv.reserve(16)
    assert len(kv.table) == 2 and p.available == 1 and p.blocks == 3


def test_a_sealed_block_is_never_rewritten():
    """Truncating into a sealed (cached, maybe shared) block drops it from the sequence and
    cuts the sequence to the block's start: those entries are computed again elsewhere."""
    p = pool(blocks=8)
    kv = SequenceKV(p)
    kv.reserve(10)
    kv.length = 10
    kv.seal(list(range(10)))
    sealed = kv.table[1]
    kv.truncate(6)
    assert kv.length == 4 and kv.table == kv.table[:1] and len(kv.hashes) == 1
    assert p.cached == 2 and sealed in p.evictable  # still cached, for whoever needs it


def test_a_thousand_random_tree_steps_leak_no_blocks(tiny_model):
    """Sequences (some sharing a prefix) verify random draft trees and keep random accepted
    paths for 1,000 steps: after each, every sequence holds exactly the blocks its entries fill
    (the tree's scratch is back), the pool counts every held block once; at the end every
    block is free or cached, none referenced."""
    flat = FlatModel(tiny_model)
    p = flat.use_pool(4096, 4, fixed=True)
    rng = random.Random(0)
    system = [rng.randrange(100) for _ in range(10)]
    live: list[tuple[SequenceKV, list[int]]] = []
    for _ in range(1000):
        if live and (rng.random() < 0.05 or len(live) > 6):
            live.pop(rng.randrange(len(live)))[0].free()
        if not live or rng.random() < 0.1:
            ids = system + [rng.randrange(100) for _ in range(rng.randint(1, 6))]
            kv = SequenceKV(p)
            kv.reuse(ids)
            live.append((kv, ids[: kv.length]))
            pending = {id(kv): ids[kv.length :]}
        segments, trees = [], []
        for kv, _ in live:
            feed = pending.get(id(kv)) or [rng.randrange(100)]
            tree = [rng.randrange(100) for _ in range(rng.randint(0, 9))]
            segments.append(Segment(kv, feed + tree))
            trees.append((feed, tree))
        pending = {}
        flat.forward(segments)
        for (kv, ids), (feed, tree) in zip(live, trees, strict=True):
            start = kv.length - len(tree)
            path = sorted(rng.sample(range(len(tree)), rng.randint(0, len(tree))))
            kv.keep(start, path)
            ids.extend(feed + [tree[i] for i in path])
            kv.seal(ids)
            assert len(kv.table) == -(-kv.length // p.block_size)
        held = {block for kv, _ in live for block in kv.table}
        assert p.used == len(held)
        assert all(p.refs[b] == sum(b in kv.table for kv, _ in live) for b in held)
    for kv, _ in live:
        kv.free()
    assert p.available == p.blocks and not any(p.refs)
    assert p.hits > 0  # the shared system prompt was reused


def test_blocks_for_several_sequences_are_taken_for_all_or_none():
    p = KVPool(2, 1, 2, torch.float32, DEVICE, block_size=4, blocks=4, fixed=True)
    a, b = SequenceKV(p), SequenceKV(p)
    with pytest.raises(OutOfBlocks):
        p.reserve([(a, 8), (b, 12)])
    assert a.table == b.table == [] and p.available == 4
    p.reserve([(a, 8), (b, 8)])
    assert len(a.table) == len(b.table) == 2


def test_only_blocks_of_known_tokens_are_sealed():
    """A sequence that ended inside an accepted draft path holds entries past its last
    emitted token: nothing past that token is cached."""
    p = pool(blocks=8)
    kv = SequenceKV(p)
    kv.reserve(12)
    kv.length = 12
    assert not kv.sealable(3) and kv.sealable(4)
    kv.seal(list(range(9)))
    assert len(kv.hashes) == 2 and p.cached == 2


def test_cached_blocks_are_shared_within_a_scope_only():
    """A sequence reuses the blocks another sealed only in the same prefix scope (a tenant,
    under `prefix_cache_scope: tenant`); scope "" (global) is one scope of its own."""
    p = pool(blocks=16)
    tokens = list(range(13))  # 3 full blocks before the last token
    sealer = SequenceKV(p, scope="tenant-a")
    sealer.reserve(len(tokens))
    sealer.length = len(tokens)
    sealer.seal(tokens)
    assert len(sealer.hashes) == 3
    reused = {
        scope: SequenceKV.start(p, tokens, reuse=True, scope=scope).length
        for scope in ("tenant-a", "tenant-b", "")
    }
    assert reused == {"tenant-a": 12, "tenant-b": 0, "": 0}
