"""Preemption's policy (services/verifier/preemption.py) on a real block pool, no model: who
goes first, and who comes back when."""

from __future__ import annotations

import torch

from helpers import make_sequence
from specserve.engine.flat_model import SequenceKV
from specserve.engine.kv_cache import KVPool
from specserve.verifier import preemption


def pool(blocks: int) -> KVPool:
    return KVPool(1, 1, 2, torch.float32, "cpu", block_size=4, blocks=blocks, fixed=True)


def holding(p: KVPool, rid: str, tokens: int, queue: str = "interactive", admitted: int = 0):
    seq = make_sequence(list(range(tokens)), rid=rid)
    seq.queue, seq.admitted_ms = queue, admitted
    seq.kv = SequenceKV(p)
    seq.kv.reserve(tokens)
    seq.kv.length = tokens
    return seq


def preempted(tokens: int):
    seq = make_sequence(list(range(100, 100 + tokens)), rid="waiting")
    seq.preempted, seq.recompute_to = True, tokens
    return seq


def test_batch_goes_first_then_the_most_recently_admitted():
    p = pool(16)
    old, new = holding(p, "old", 4, admitted=1), holding(p, "new", 4, admitted=2)
    batch = holding(p, "batch", 4, "batch", admitted=0)
    assert [s.request_id for s in preemption.victims([old, new, batch])] == ["batch", "new", "old"]


def test_a_preempted_sequence_comes_back_with_its_tokens_and_the_watermark_left():
    p = pool(8)
    seq = holding(p, "s", 10)
    seq.kv.seal(seq.all_ids)
    preemption.preempt(seq)
    assert seq.preempted and seq.kv is None and seq.recompute_to == 10 and p.available == 8
    other = holding(p, "o", 16)  # 4 blocks held: 4 free
    assert not preemption.resume(seq, p, True, watermark=2)  # needs 3 (2 cached) + 2 left
    assert preemption.resume(seq, p, True, watermark=1)
    assert not seq.preempted and seq.kv.length == 8 and len(seq.kv.table) == 3
    assert seq.prefilling  # it computes tokens 8..9 again before it goes on
    other.kv.free()


def test_paused_holders_are_preempted_for_a_waiting_sequence():
    """Only paused sequences hold blocks: nothing would ever free them for the one waiting."""
    p = pool(4)
    paused = holding(p, "paused", 16)
    paused.pause(True)
    waiting = preempted(8)
    assert preemption.resume_waiting([paused, waiting], p, True, watermark=1) == 0
    assert paused.preempted and not waiting.preempted


def test_a_running_holder_is_waited_for():
    p = pool(4)
    running = holding(p, "running", 16)
    waiting = preempted(8)
    assert preemption.resume_waiting([running, waiting], p, True, watermark=0) == 1
    assert not running.preempted and waiting.preempted
