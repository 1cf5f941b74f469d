"""Owns the target model and runs its forward passes; the only code that touches KV caches."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..engine.flat_model import FlatModel, Segment
from ..engine.tensor_parallel import ShardsLost
from ..speculation.tree import DraftTree
from .constraint import GrammarViolation
from .sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    """One forward pass per step over every running sequence: each sequence's unseen tokens
    (the prompt at first, then the last emitted token) followed by its draft tree's nodes.

    A sequence's KV buffer holds all_ids[:kv.length]; commit keeps the accepted path."""

    def __init__(self, model: FlatModel):
        self.model = model

    def lost(self) -> str | None:
        """Why the model can run no more steps (a tensor-parallel rank was lost), if so."""
        return self.model.shards.lost if self.model.shards is not None else None

    def verify(
        self, seqs: list[Sequence], trees: list[DraftTree], takes: list[int | None] | None = None
    ) -> list[torch.Tensor]:
        """Target logits per sequence: [nodes + 1, vocab]; row 0 follows the last pending token
        fed and row i + 1 follows tree node i. Each sequence feeds `takes` of its pending tokens
        (all when None; fewer: a prefill chunk, whose logits mean nothing yet). On a device the
        logits may still be being computed when this returns."""
        segments = []
        for seq, tree, take in zip(seqs, trees, takes or [None] * len(seqs), strict=True):
            if seq.kv is None:  # (admission gives every served sequence its KV)
                seq.kv = self.model.new_kv()
            segments.append(tree_segment(seq, tree, take))
        return self.model.forward(segments)  # (selection runs where they are)

    def verify_each(
        self, seqs: list[Sequence], trees: list[DraftTree], takes: list[int | None]
    ) -> list[torch.Tensor | Exception]:
        """`verify`, with a failure kept to the sequences it belongs to: per sequence its
        logits, or the error that stops it (its KV back where it was). A failed batched pass is
        run again one sequence at a time, so the others get the rows they would have got.
        Rows holding NaN or inf (a float16 overflow, say) are found by selection, in the
        step's one read of its results (acceptance.NonFinite). Prefilling sequences are
        charged the pass's time (`prefill_ms`; on a device, up to its last kernel's launch)."""
        started = time.perf_counter()
        prefilling = [seq for seq in seqs if seq.prefilling]
        computed = [seq.num_computed for seq in seqs]
        try:
            results = self.verify(seqs, trees, takes)
        except ShardsLost:
            rewind(seqs, computed)
            raise  # (not the sequences' failure: the engine hands them back)
        except Exception as e:
            rewind(seqs, computed)
            if len(seqs) == 1:
                return [StepFailed(f"the forward pass failed: {describe(e)}")]
            log.warning(
                "batched forward pass failed; running its sequences one by one",
                extra={"requests": len(seqs), "error": describe(e)},
            )
            return [
                self.verify_each([seq], [tree], [take])[0]
                for seq, tree, take in zip(seqs, trees, takes, strict=True)
            ]
        elapsed_ms = (time.perf_counter() - started) * 1000
        for seq in prefilling:
            seq.prefill_ms += elapsed_ms
        return results

    @torch.inference_mode()
    def pass_timer(self, context: int = 256):
        """`time_pass(tokens) -> seconds`: one forward pass of `tokens` tokens checked as a
        tree step checks them (their own mask, a logit row each) after `context` tokens of a
        scratch sequence, read back so the device has finished; the most tokens a pass may
        have (what the KV pool holds past the context); and `done()`, which frees the scratch
        KV. For the adaptive policy's verify profile (Speculator.calibrate)."""
        pool = self.model.pool
        room = pool.available * pool.block_size - pool.block_size  # (a partial last block)
        context = max(1, min(context, room // 2))
        kv = self.model.new_kv()
        self.model.forward([Segment(kv, [0] * context)])

        def time_pass(tokens: int) -> float:
            length = kv.length
            mask = np.tri(tokens, dtype=bool)
            positions = list(range(length, length + tokens))
            started = time.perf_counter()
            (rows,) = self.model.forward(
                [Segment(kv, [0] * tokens, positions, mask, logits_from=0)]
            )
            rows[-1, 0].item()
            seconds = time.perf_counter() - started
            kv.truncate(length)
            return seconds

        return time_pass, room - context, kv.free

    @staticmethod
    def commit(seq: Sequence, tree: DraftTree, accepted: list[int]) -> None:
        """Keeps the KV entries of the accepted nodes right after the pending tokens."""
        tree_start = seq.kv.length - len(tree)
        seq.kv.keep(tree_start, accepted)

    @staticmethod
    def release(seq: Sequence) -> None:
        """Gives the sequence's KV blocks back; its sealed ones stay in the prefix cache."""
        if seq.kv is not None:
            seq.kv.free()
            seq.kv = None


class StepFailed(RuntimeError):
    """A sequence's step could not be computed; the message is for its client."""


def rewind(seqs: list[Sequence], computed: list[int]) -> None:
    """Puts each sequence's KV back to `computed` entries (what it held before the step)."""
    for seq, length in zip(seqs, computed, strict=True):
        if seq.kv is not None:
            seq.kv.truncate(length)


def describe(error: BaseException) -> str:
    """An error's type and first line, short enough for a client to read."""
    if isinstance(error, StepFailed | GrammarViolation):
        return str(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def tree_segment(seq: Sequence, tree: DraftTree, take: int | None = None) -> Segment:
    """pending tokens (causal; the first `take` of them) + tree nodes, each node seeing the
    prefix and its ancestors; node position = position after the pending tokens + depth."""
    pending = seq.pending_input(take)
    past, p, n = seq.num_computed, len(pending), len(tree)
    if n == 0:
        return Segment(seq.kv, pending)
    mask = np.tri(p + n, dtype=bool)
    mask[p:, p:] = tree.ancestor_mask()
    base = past + p
    positions = list(range(past, base)) + [base + d for d in tree.depths()]
    return Segment(seq.kv, pending + tree.token_ids, positions, mask, logits_from=p - 1)
