"""Draft token trees: what a proposer returns and the verifier checks.

Node i holds token_ids[i]; its parent is parents[i] (-1: the root, i.e. the sequence's last
token). Parents come before children. Siblings are listed in the order they were drawn, which
matters for rejection sampling.

`scores` (model-free trees, optional) holds per node the proposer's estimate of the chance
that the target keeps the path to it; their sum is the tree's expected accepted tokens. A
scored tree lists its nodes likeliest first, so `prefix(n)` (its first n nodes) is the best
tree of n nodes by that estimate.

`dists` maps a node (-1 for the root) to the draft distribution its children were drawn from,
as a sparse (token ids, probabilities) pair. A node without one has deterministic children
(greedy top-k or n-gram drafts): rejection sampling then treats each child as a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftTree:
    token_ids: list[int] = field(default_factory=list)  # [nodes]
    parents: list[int] = field(default_factory=list)  # [nodes], -1 = root
    dists: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    model_free: bool = False  # drawn by no model (a suffix or n-gram match): costs no draft pass
    scores: list[float] = field(default_factory=list)  # [nodes] or empty: see the module doc

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(self, token: int, parent: int) -> int:
        self.token_ids.append(token)
        self.parents.append(parent)
        return len(self.token_ids) - 1

    def prefix(self, n: int) -> DraftTree:
        """The tree of the first n nodes (parents come first, so it is one)."""
        if n >= len(self):
            return self
        dists = {node: d for node, d in self.dists.items() if node < n}
        return DraftTree(
            self.token_ids[:n], self.parents[:n], dists, self.model_free, self.scores[:n]
        )

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 0."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        return depth

    def children(self) -> dict[int, list[int]]:
        """Node (-1: root) -> its children in listed order."""
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            kids.setdefault(p, []).append(i)
        return kids

    def ancestor_mask(self) -> np.ndarray:
        """[nodes, nodes] bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self)
        mask = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def path(self, node: int) -> list[int]:
        """Tokens from the root's first child down to node."""
        tokens = []
        while node >= 0:
            tokens.append(self.token_ids[node])
            node = self.parents[node]
        return tokens[::-1]

    def matched(self, tokens: list[int]) -> int:
        """How many of `tokens` follow one path of the tree from the root: after a step, the
        draft tokens the target kept (its own next token then matches no child)."""
        kids, node, n = self.children(), -1, 0
        for token in tokens:
            node = self.child(kids, node, token)
            if node is None:
                break
            n += 1
        return n

    def child(self, kids: dict[int, list[int]], node: int, token: int) -> int | None:
        """The child of `node` (-1: the root) that holds `token`, if any (`kids`: children())."""
        return next((c for c in kids.get(node, ()) if self.token_ids[c] == token), None)

    def tested(self, accepted: int) -> int:
        """Draft tokens the target checked when it kept a path of `accepted` of them: those,
        and the first rejection where the path stopped short of the deepest level."""
        return accepted + (accepted < max(self.depths()) + 1)

    def validate(self, vocab_size: int) -> None:
        """Raises ValueError when the tree is malformed (it came over the network)."""
        if len(self.parents) != len(self.token_ids):
            raise ValueError("token_ids and parent_indices differ in length")
        for i, (t, p) in enumerate(zip(self.token_ids, self.parents, strict=True)):
            if not 0 <= t < vocab_size:
                raise ValueError(f"node {i}: token {t} outside the vocabulary")
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} does not come before it")
        for node, (ids, probs) in self.dists.items():
            if not -1 <= node < len(self) or len(ids) != len(probs):
                raise ValueError(f"draft distribution of node {node} is malformed")
            if any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"draft distribution of node {node} has tokens out of vocab")
            if not all(0.0 <= q <= 1.0 for q in probs):  # also false for NaN
                raise ValueError(f"draft distribution of node {node} has invalid probabilities")
        if self.scores and len(self.scores) != len(self):
            raise ValueError(f"{len(self.scores)} node scores for {len(self)} nodes")
        if not all(0.0 <= s <= 1.0 for s in self.scores):
            raise ValueError("node scores must lie in [0, 1]")


def node_limit(tree: DraftTree, budget: int, deep_budget: int) -> int:
    """The most nodes a tree may have in a step that gave its sequence these budgets: a
    model-free tree the deep budget; any other the larger of the two (a draft model's tree, or
    the hybrid's union of one with a suffix tree), and none where the draft model had none."""
    if tree.model_free:
        return deep_budget
    return max(budget, deep_budget) if budget else 0


def union(first: DraftTree, second: DraftTree, limit: int) -> DraftTree:
    """`first` whole, then `second`'s nodes in their order, each merged into a node already
    there for the same token under the same parent, or added while the tree has fewer than
    `limit` nodes (a node whose parent found no room goes too): every path of the result is a
    path of one of the two. For deterministic trees only: `second` carries no draws."""
    model_free = first.model_free and second.model_free
    tree = DraftTree(list(first.token_ids), list(first.parents), dict(first.dists), model_free)
    at = {(p, t): i for i, (t, p) in enumerate(zip(first.token_ids, first.parents, strict=True))}
    where: dict[int, int] = {-1: -1}  # second's node -> its node in the result
    for i, (token, parent) in enumerate(zip(second.token_ids, second.parents, strict=True)):
        if (up := where.get(parent)) is None:
            continue
        if (node := at.get((up, token))) is None and len(tree) < limit:
            node = at[(up, token)] = tree.add(token, up)
        if node is not None:
            where[i] = node
    return tree


def to_proto(tree: DraftTree, msg) -> None:
    """Fills a specserve.v1.DraftTree message."""
    msg.token_ids.extend(tree.token_ids)
    msg.parent_indices.extend(tree.parents)
    msg.model_free = tree.model_free
    msg.node_scores.extend(tree.scores)
    for node, (ids, probs) in tree.dists.items():
        msg.distributions.add(node_index=node, token_ids=ids, probs=probs)


def from_proto(msg) -> DraftTree:
    return DraftTree(
        token_ids=list(msg.token_ids),
        parents=list(msg.parent_indices),
        dists={d.node_index: (list(d.token_ids), list(d.probs)) for d in msg.distributions},
        model_free=msg.model_free,
        scores=list(msg.node_scores),
    )
