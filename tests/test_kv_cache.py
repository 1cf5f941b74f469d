"""The block pool: blocks taken as positions are written, given back, never leaked."""

from __future__ import annotations

import random

import torch

from conftest import DEVICE
from specserve.common.flat_model import FlatModel, Segment
from specserve.common.kv_cache import KVPool, SequenceKV


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
    assert sorted(p.free_blocks) == [0, 1, 2, 3]


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
