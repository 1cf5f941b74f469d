"""The `ngram` proposer: prompt lookup. Matches the latest tokens against the history and
proposes what followed its earliest occurrences; several matches merge into a tree. Free,
deterministic."""

from __future__ import annotations

from ..common.settings import DrafterSettings
from .proposer import DraftJob, Proposer, TreeShape
from .tree import DraftTree


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, shape: TreeShape, min_ngram: int = 1, max_ngram: int = 4, matches=4):
        self.shape = shape
        self.min_ngram, self.max_ngram, self.matches = min_ngram, max_ngram, matches

    @classmethod
    def from_settings(cls, settings: DrafterSettings) -> NgramProposer:
        shape = TreeShape(max_depth=settings.ngram_depth)
        return cls(shape, settings.ngram_min, settings.ngram_max)

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        return [self.propose_one(job.tokens, job.free_budget) for job in jobs]

    def forget(self, seq_id: str) -> None:
        """Nothing to free: the proposer keeps no state."""

    def propose_one(self, tokens: list[int], budget: int) -> DraftTree:
        tree = self.lookup(tokens, budget)[0]
        tree.model_free = True
        return tree

    def lookup(self, tokens: list[int], budget: int) -> tuple[DraftTree, int]:
        """The tree from the longest suffix that occurred before, and that suffix's length."""
        tree = DraftTree()
        depth = self.shape.max_depth
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            for start in self._matches(tokens, n):
                self._insert(tree, tokens[start + n : start + n + depth], budget)
                if len(tree) >= budget:
                    return tree, n
            if len(tree):
                return tree, n
        return tree, 0

    def _matches(self, tokens: list[int], n: int):
        """Starts of earlier occurrences of the last n tokens, earliest first: text being
        edited or quoted usually sits in the prompt, before the output that copies it."""
        key = tokens[-n:]
        first = key[0]
        found = 0
        for start in range(len(tokens) - n):
            if tokens[start] == first and tokens[start : start + n] == key:
                yield start
                found += 1
                if found >= self.matches:
                    return

    @staticmethod
    def _insert(tree: DraftTree, continuation: list[int], budget: int) -> None:
        """Adds a continuation as a path, sharing the prefix it has with existing paths."""
        node = -1
        kids = tree.children()
        for token in continuation:
            same = next((c for c in kids.get(node, []) if tree.token_ids[c] == token), None)
            if same is None:
                if len(tree) >= budget:
                    return
                same = tree.add(token, node)
                kids.setdefault(node, []).append(same)
            node = same
