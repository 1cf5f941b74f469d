"""Preemption: what the engine does when a step needs more KV blocks than the pool has free.

Running out of blocks never fails a step. The step takes its blocks before its forward pass,
all at once (so that no admission takes them in between). If they are not there, the step's
draft trees go first (plain decoding needs at most one new block per sequence); if that is not
enough, sequences are preempted, the batch class before the interactive one and the most
recently admitted first (they have done the least work), until the rest fits. A preempted
sequence gives its blocks back (its sealed ones stay in the prefix cache), keeps its output and
its sampler's state, and waits; once the blocks it needs are free, with the watermark left for
the sequences that run, it is prefilled again, through the prefix cache where its blocks are
still there, and goes on. Its client sees nothing but a pause: every emitted token stands, and
it continues from the same index (recompute, as vLLM does; no swap).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..engine.flat_model import OutOfBlocks, SequenceKV
from ..engine.kv_cache import KVPool
from ..speculation.tree import DraftTree
from . import metrics
from .sequence import Sequence
from .step_plan import StepPlan

log = logging.getLogger(__name__)


def fit(
    plan: StepPlan, trees: list[DraftTree], running: Iterable[Sequence], pool: KVPool
) -> list[DraftTree]:
    """Takes the step's blocks: for its own trees if they fit, else for no trees, preempting
    sequences (`victims`) until the rest fits; `plan` loses the parts of the preempted.
    Returns the trees the step runs with."""
    if take_step_blocks(plan, trees, pool):
        return trees
    trees = [DraftTree() for _ in trees]
    for seq in victims(running):
        if take_step_blocks(plan, trees, pool):
            return trees
        preempt(seq)
        kept = [i for i, part in enumerate(plan.parts) if part.seq is not seq]
        plan.parts, trees = [plan.parts[i] for i in kept], [trees[i] for i in kept]
    take_step_blocks(plan, trees, pool)  # (nothing left to preempt: an empty step fits)
    return trees


def take_step_blocks(plan: StepPlan, trees: list[DraftTree], pool: KVPool) -> bool:
    """Takes the blocks the step's new tokens and tree nodes need, for every part or none;
    False if the pool has too few."""
    needs = [
        (part.seq.kv, part.seq.num_computed + part.take + len(tree))
        for part, tree in zip(plan.parts, trees, strict=True)
        if part.seq.kv is not None
    ]
    try:
        pool.reserve(needs)
    except OutOfBlocks:
        return False
    return True


def victims(running: Iterable[Sequence]) -> list[Sequence]:
    """Sequences holding blocks, in the order they are preempted: batch class first, then
    the most recently admitted."""
    holding = [s for s in running if s.kv is not None and s.kv.table and not s.finish_reason]
    return sorted(holding, key=lambda s: (s.queue == "interactive", -s.admitted_ms))


def preempt(seq: Sequence) -> None:
    """Gives the sequence's blocks back; it is recomputed up to every token it has."""
    seq.kv.free()
    seq.kv = None
    seq.preempted = True
    seq.preemptions += 1
    seq.recompute_to = len(seq.all_ids)
    metrics.PREEMPTIONS.inc()
    log.info("preempted", extra={"request_id": seq.request_id, "tokens": seq.recompute_to})


def resume_waiting(
    running: list[Sequence], pool: KVPool, prefix_cache: bool, watermark: int
) -> int:
    """Resumes preempted sequences in the order they are owed (interactive first, then the
    earliest admitted) while their blocks are free; returns how many still wait. When the
    only sequences holding blocks are paused (their clients are not reading), they are
    preempted in turn for the first one waiting: nothing else would free blocks."""
    waiting = [s for s in running if s.preempted and not s.finish_reason]
    waiting.sort(key=lambda s: (s.queue != "interactive", s.admitted_ms))
    for count, seq in enumerate(waiting):
        holders = victims(running)
        reserve = watermark if any(s.paused_since is None for s in holders) else 0
        while not resume(seq, pool, prefix_cache, reserve):
            if not holders or any(s.paused_since is None for s in holders):
                return len(waiting) - count
            preempt(holders.pop(0))
        log.info("resumed", extra={"request_id": seq.request_id, "tokens": seq.recompute_to})
    return 0


def resume(seq: Sequence, pool: KVPool, prefix_cache: bool, watermark: int = 0) -> bool:
    """Gives a preempted sequence the blocks of its tokens (cached ones by reference) if they
    are free with `watermark` blocks left over; False (nothing taken) if not."""
    try:
        seq.kv = SequenceKV.start(
            pool, seq.all_ids, reuse=prefix_cache, keep_free=watermark, scope=seq.prefix_scope
        )
    except OutOfBlocks:
        return False
    seq.preempted = False
    return True
