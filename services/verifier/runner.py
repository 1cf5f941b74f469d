"""Owns the target model and runs its forward passes; the only code that touches KV caches."""

from __future__ import annotations

import time

import torch

from ..common.flat_model import FlatModel, Segment
from ..common.tree import DraftTree
from .sequence import Sequence


class ModelRunner:
    """One forward pass per step over every running sequence: each sequence's unseen tokens
    (the prompt at first, then the last emitted token) followed by its draft tree's nodes.

    A sequence's KV buffer holds all_ids[:kv.length]; commit keeps the accepted path."""

    def __init__(self, model: FlatModel):
        self.model = model

    def verify(
        self, seqs: list[Sequence], trees: list[DraftTree], takes: list[int | None] | None = None
    ) -> list[torch.Tensor]:
        """Target logits per sequence: [nodes + 1, vocab]; row 0 follows the last pending token
        fed and row i + 1 follows tree node i. Each sequence feeds `takes` of its pending tokens
        (all when None; fewer: a prefill chunk, whose logits mean nothing yet)."""
        started = time.perf_counter()
        segments = []
        prefilling = [seq for seq in seqs if seq.prefilling]
        for seq, tree, take in zip(seqs, trees, takes or [None] * len(seqs), strict=True):
            if seq.kv is None:
                seq.kv = self.model.new_kv(len(seq.all_ids) + 64, seq.kv_limit)
            segments.append(tree_segment(seq, tree, take))
        logits = [rows.cpu() for rows in self.model.forward(segments)]  # acceptance runs here
        elapsed_ms = (time.perf_counter() - started) * 1000
        for seq in prefilling:
            seq.prefill_ms += elapsed_ms
        return logits

    @staticmethod
    def commit(seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        """Keeps the KV entries of the accepted nodes right after the pending tokens."""
        tree_start = seq.kv.length - len(tree)
        seq.kv.keep(tree_start, accepted)

    @staticmethod
    def release(seq: Sequence) -> None:
        seq.kv = None


def tree_segment(seq: Sequence, tree: DraftTree, take: int | None = None) -> Segment:
    """pending tokens (causal; the first `take` of them) + tree nodes, each node seeing the
    prefix and its ancestors; node position = position after the pending tokens + depth."""
    pending = seq.pending_input(take)
    past, p, n = seq.num_computed, len(pending), len(tree)
    if n == 0:
        return Segment(seq.kv, pending)
    visible = torch.ones(p + n, past + p + n, dtype=torch.bool)
    visible[:p, past:] = torch.ones(p, p + n, dtype=torch.bool).tril()
    visible[p:, past + p :] = tree.ancestor_mask()
    base = past + p
    positions = list(range(past, base)) + [base + d for d in tree.depths()]
    return Segment(seq.kv, pending + tree.token_ids, positions, visible, logits_from=p - 1)
