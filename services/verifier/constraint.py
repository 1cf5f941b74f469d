"""A request's grammar on the verifier (structured outputs): which tokens may come next at
every row of its step, so that selection only ever keeps tokens the grammar allows.

The matcher (speculation/grammar.py) stands at the sequence's committed output. For a step, it is
walked down the draft tree depth first, consuming each node's token and rolling back after
its subtree, and the mask of allowed tokens is computed at the root and after every node:
row i of the masks is the grammar's answer for logits row i. Selection (acceptance.py) sets
the target's disallowed logits to -inf before it decides, so greedy output is plain
constrained decoding's token for token, and sampled output follows the constrained target
distribution: the draft proposes, the masked target decides, as without a grammar.

Before that, drafts are shaped by the grammar where it is free to: nodes whose token the
grammar does not allow are cut from deterministic trees (they could never be accepted), and
where the grammar forces the next tokens (a schema's keys and punctuation), those tokens are
the step's draft, a chain that costs no draft pass and that the target accepts whole (its
masked distribution there is a point mass).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import llguidance.torch
import torch

from ..speculation.tree import DraftTree

if TYPE_CHECKING:
    from .step_plan import StepPlan

FORCED_MAX = 16  # tokens of a forced run drafted in one step


class GrammarViolation(RuntimeError):
    """The matcher can go no further: its grammar ran past the engine's limits (a grammar
    that compiles may still need more work per token than `LLParserLimits` allow), or a token
    it does not allow reached it. The message says which; the request ends with it."""


class Constraint:
    """One sequence's matcher, at its output so far (`consumed` tokens of it)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: set[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.consumed = 0

    def consume(self, token: int) -> None:
        """Takes an output token. An end of sequence is not given to the matcher (it ends the
        output: the grammar need only allow it, and llguidance does not count it as a token
        to roll back)."""
        if token in self.eos_ids:
            if not self.matcher.is_accepting():
                raise self._stopped("the output ended before its grammar allows")
            return
        if not self.matcher.consume_token(token):
            raise self._stopped(self.matcher.get_error()[:200])
        self.consumed += 1

    def _check(self) -> None:
        if self.matcher.is_error():
            raise self._stopped(self.matcher.get_error()[:200])

    def _stopped(self, why: str) -> GrammarViolation:
        return GrammarViolation(f"grammar: stopped at output token {self.consumed}: {why}")

    def rollback_to(self, consumed: int) -> None:
        """Back to the state after `consumed` tokens (a step that failed is undone)."""
        if consumed < self.consumed:
            self.matcher.rollback(self.consumed - consumed)
            self.consumed = consumed

    @property
    def complete(self) -> bool:
        """The output is a whole string of the grammar, and nothing may follow it."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def forced(self, limit: int) -> DraftTree | None:
        """The tokens the grammar forces next, as a chain of at most `limit`; None if none."""
        tokens = self.matcher.compute_ff_tokens()[: min(limit, FORCED_MAX)]
        self._check()
        if not tokens:
            return None
        return DraftTree(tokens, list(range(-1, len(tokens) - 1)), model_free=True)

    def masks(self, tree: DraftTree) -> tuple[torch.Tensor, list[bool]]:
        """[nodes + 1, words] int32 bitmasks, row 0 at the current state and row i + 1 after
        node i's path; and per node whether the grammar allows its path. A node the grammar
        does not allow has its row left all ones: it is never accepted, so its row is never
        read."""
        masks = llguidance.torch.allocate_token_bitmask(len(tree) + 1, self.vocab_size)
        legal = [False] * len(tree)
        kids = tree.children()
        llguidance.torch.fill_next_token_bitmask(self.matcher, masks, 0)
        self._check()

        def down(node: int) -> None:  # the matcher stands at `node`'s path
            row = masks[node + 1]
            for child in kids.get(node, []):
                token = tree.token_ids[child]
                if not _allows(row, token):
                    continue
                legal[child] = True
                if token in self.eos_ids:
                    continue  # (nothing follows an end of sequence; its row is never read)
                self.consume(token)
                llguidance.torch.fill_next_token_bitmask(self.matcher, masks, child + 1)
                self._check()
                down(child)
                self.rollback_to(self.consumed - 1)

        down(-1)
        return masks, legal

    def prune(self, tree: DraftTree) -> DraftTree:
        """The tree without the nodes the grammar does not allow (and their subtrees). A tree
        with draft distributions is kept whole: sampled children are rejected in their drawn
        order, and leaving a draw out would change what the rest are accepted with."""
        if not len(tree) or tree.dists:
            return tree
        _, legal = self.masks(tree)
        if all(legal):
            return tree
        kept = DraftTree(model_free=tree.model_free)
        index: dict[int, int] = {-1: -1}
        for i, (token, parent) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
            if legal[i] and parent in index:
                index[i] = kept.add(token, index[parent])
        return kept


class StepGrammar:
    """The grammars of a step's sequences: their drafts shaped by them (`guide`), and each
    part's masks (`masks`), computed on a thread of their own."""

    def __init__(self, max_seq_len: int, forced_drafts: bool):
        self.max_seq_len = max_seq_len
        self.forced_drafts = forced_drafts  # a grammar's forced tokens are the draft
        self._thread = ThreadPoolExecutor(1, "grammar")

    def guide(self, plan: StepPlan, trees: list[DraftTree]) -> list[DraftTree]:
        """The drafts of sequences with a grammar, shaped by it: where it forces the next
        tokens, they are the draft; else the tree less what it rules out."""
        guided = []
        for part, tree in zip(plan.parts, trees, strict=True):
            seq = part.seq
            if seq.constraint is not None and seq.speculate and not part.prefilling:
                left = min(seq.max_tokens, self.max_seq_len - len(seq.prompt_ids))
                try:
                    forced = None
                    if self.forced_drafts:
                        forced = seq.constraint.forced(left - len(seq.output_ids) - 1)
                    shaped = forced if forced is not None else seq.constraint.prune(tree)
                    seq.drafted += len(shaped) - len(tree)  # (what the target verifies)
                    tree = shaped
                except GrammarViolation:
                    pass  # (its masks say so, and end it)
            guided.append(tree)
        return guided

    def masks(self, plan: StepPlan, trees: list[DraftTree]) -> Future:
        """Each part's grammar masks (None without a grammar, or for a prompt chunk that
        emits nothing), computed on a thread of their own: the grammar engine leaves the
        interpreter lock while it works, so they are ready when the forward pass is."""

        def masks() -> list[torch.Tensor | GrammarViolation | None]:
            found = []
            for part, tree in zip(plan.parts, trees, strict=True):
                try:
                    found.append(
                        part.seq.constraint.masks(tree)[0]
                        if part.seq.constraint is not None and part.complete
                        else None
                    )
                except GrammarViolation as e:
                    found.append(e)
            return found

        if not any(part.seq.constraint is not None for part in plan.parts):
            done: Future = Future()
            done.set_result([None] * len(plan.parts))
            return done
        return self._thread.submit(masks)


def _allows(row: torch.Tensor, token: int) -> bool:
    return token >> 5 < row.shape[0] and ((int(row[token >> 5]) >> (token & 31)) & 1) == 1
