"""Recursive rejection sampling on the device, for every node of every sampling tree at once.

The rule is defined in acceptance.py. Here every node with children (a "parent", the root
included) runs its sibling recursion at the same time: a [parents, vocab] tensor holds each
parent's current p, and the loop goes over sibling rank, testing the i-th child of every
parent together. A parent's first child to pass its test is the one it accepts (later ranks
are computed and ignored); its p after all its children is its residual, from which the
walk draws its bonus token when all of them are rejected. Every parent tests with uniforms
of its own, drawn up front from its sequence's generator (one per child rank).

Vectorised: target_probs over the parent rows (one call for all sequences that share their
sampling parameters), the p/q ratios of a rank for every parent (one gather), the residual
update (a scatter over the draft distribution's support, or over the child's token for a
point mass, on p kept unnormalised: no pass over the vocabulary per rank), the choice of
child. Sequential: the loop over sibling rank; the random draws (one call per sequence: each
has its own generator); and the bonus draw, which waits for the path, as only then is its
row known (one uniform a sequence, by inverse CDF).

On a CPU whose kernels run, sequences sampling at a temperature alone have the target's
weights of their parent and leaf rows computed by kernels.softmax_weights, reading the rows
where the forward pass left them (two passes each, against a gather, a copy, a division and
softmax's passes), and the bonus tokens drawn by kernels.draw (`kernel_weights`); top-k and
top-p take target_probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..engine import kernels
from ..engine.batch import Packer, to_device
from .logit_rows import back_to_back
from .sampling import SamplingParams, target_probs
from .tree import DraftTree

if TYPE_CHECKING:
    from .acceptance import Candidates

_EPS = 1e-12


@dataclass
class Parents:
    """The nodes with children of a group of trees, as tensors: parent j, child rank i."""

    seq: list[int]  # [parents]: its sequence in the group (parents come sequence by sequence)
    node: list[int]  # [parents]: its node in its tree (-1: the root)
    rows: torch.Tensor  # [parents]: its row in its sequence's logits (node + 1)
    children: torch.Tensor  # [parents, width]: its children, numbered through the group
    tokens: torch.Tensor  # [parents, width]: their tokens (0 past the last child)
    live: torch.Tensor  # [parents, width] bool: whether it has an i-th child
    has_dist: torch.Tensor  # [parents, 1] bool: its children were drawn from a distribution
    support: torch.Tensor  # [parents, support]: that distribution's tokens (padded with 0)
    q: torch.Tensor  # [parents, support] float32: and their probabilities (padded with 0)

    @classmethod
    def of(cls, trees: list[DraftTree], device: torch.device) -> Parents:
        seq, node, kids, dists = [], [], [], []
        offset = 0
        for s, tree in enumerate(trees):
            for parent, children in sorted(tree.children().items()):
                seq.append(s)
                node.append(parent)
                kids.append([(offset + c, tree.token_ids[c]) for c in children])
                dist = tree.dists.get(parent)  # a token listed twice: its last probability
                dists.append(dict(zip(*dist, strict=True)) if dist is not None else None)
            offset += len(tree)
        width = max(map(len, kids), default=0)
        support = max((len(d) for d in dists if d), default=1)

        def host(rows: list[list], columns: int, dtype=np.int64) -> np.ndarray:
            out = np.zeros((len(rows), columns), dtype=dtype)
            for r, row in enumerate(rows):
                out[r, : len(row)] = row
            return out

        # The integers cross to the device in one copy, the probabilities in another.
        packer = Packer()
        handles = [
            packer.add([n + 1 for n in node]),  # each parent's row
            packer.add(host([[c for c, _ in k] for k in kids], width)),
            packer.add(host([[t for _, t in k] for k in kids], width)),
            packer.add(host([[1] * len(k) for k in kids], width)),
            packer.add(host([[int(d is not None)] for d in dists], 1)),
            packer.add(host([list(d or {}) for d in dists], support)),
        ]
        buffer = packer.send(device)
        rows, children, tokens, live, has_dist, support_ids = (
            Packer.view(buffer, h) for h in handles
        )
        q = host([list((d or {}).values()) for d in dists], support, np.float32)
        return cls(
            seq,
            node,
            rows,
            children,
            tokens,
            live != 0,
            has_dist != 0,
            support_ids,
            to_device(q, device),
        )


@dataclass
class Decision:
    """What the parents of a group of sampling sequences decided."""

    group: list[Candidates]
    parents: Parents
    chosen: torch.Tensor  # [nodes] bool: the child each parent accepts (at most one each)
    residual: torch.Tensor  # [parents, vocab]: each parent's p after all its children, unnormalised

    def bonus(self, ends: list[int]) -> list[int]:
        """The bonus token of each sequence whose walk ended at node ends[s] (-1: the root):
        drawn from that node's residual if it has children, else from p at its row, by
        inverse CDF with one uniform from the sequence's generator (exact for weights that
        need not sum to 1: the residual is kept unnormalised); the tokens come back in one
        transfer."""
        parents = zip(self.parents.seq, self.parents.node, strict=True)
        index = {key: j for j, key in enumerate(parents)}  # (sequence, node) -> parent
        at = [index.get((s, end)) for s, end in enumerate(ends)]
        leaves = [
            (s, end + 1) for s, (end, j) in enumerate(zip(ends, at, strict=True)) if j is None
        ]
        leaf_weights = iter(self._leaves(leaves).unbind() if leaves else ())
        weights = torch.stack(
            [self.residual[j] if j is not None else next(leaf_weights) for j in at]
        )  # [seqs, vocab]
        device = weights.device
        u = torch.cat([torch.rand(1, generator=c.generator, device=device) for c in self.group])
        drawn = kernels.draw(weights, u)
        return (drawn if drawn is not None else inverse_cdf(weights, u)).tolist()

    def _leaves(self, rows: list[tuple[int, int]]) -> torch.Tensor:
        """The target's distribution at these (sequence, row) pairs, as weights."""
        fast = kernel_weights(self.group, rows)
        if fast is not None:
            return fast[0]
        return probs([(self.group[s].logits[r : r + 1], self.group[s].params) for s, r in rows])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """weights [rows, vocab] (non-negative, any sum), u [rows] uniform in [0, 1) -> [rows]:
    each row's token i with probability weights[i] / sum: the first whose cumulative weight
    exceeds u * sum. Never a token of weight 0: a cumulative sum of non-negative numbers only
    rises at a token with weight, and the index is kept at or below the last such token (the
    first maximum of the sums) should rounding put u * sum at the total."""
    cumulative = weights.cumsum(-1)  # [rows, vocab]
    target = u[:, None] * cumulative[:, -1:]  # [rows, 1]
    token = torch.searchsorted(cumulative, target, right=True)[:, 0]
    return torch.minimum(token, cumulative.argmax(-1))


def decide(group: list[Candidates]) -> Decision:
    """Every parent's choice among its children, for a group of sampling sequences."""
    device = group[0].logits.device
    trees = [c.tree for c in group]
    parents = Parents.of(trees, device)
    nodes = sum(map(len, trees))
    chosen = torch.zeros(nodes + 1, dtype=torch.bool, device=device)
    if not parents.seq:
        return Decision(group, parents, chosen[:nodes], torch.zeros(0, device=device))
    width = parents.children.shape[1]
    counts = [parents.seq.count(s) for s in range(len(group))]
    u = [
        torch.rand(count, width, generator=c.generator, device=device)
        for c, count in zip(group, counts, strict=True)
        if count
    ]
    fast = kernel_weights(
        group, [(s, n + 1) for s, n in zip(parents.seq, parents.node, strict=True)]
    )
    if fast is not None:
        p, norm = fast
    else:
        pieces = [
            (c.logits[index], c.params)  # [count, vocab]
            for c, index, count in zip(group, parents.rows.split(counts), counts, strict=True)
            if count
        ]
        p = probs(pieces)
        norm = p.sum(1, keepdim=True)
    passed, residual = siblings(p, torch.cat(u), parents, norm)
    rank = passed.int().argmax(1, keepdim=True)  # [parents, 1]: its first child to pass
    child = parents.children.gather(1, rank)[:, 0]  # [parents]
    chosen[torch.where(passed.any(1), child, nodes)] = True
    return Decision(group, parents, chosen[:nodes], residual)


def kernel_weights(
    group: list[Candidates], rows: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's distribution at each (sequence, row) of the group's logits, in order, as
    weights [len(rows), vocab] (unnormalised) and their sums [len(rows), 1], through
    kernels.softmax_weights, which reads the rows in place in two passes: where the logits lie
    back to back in float32 on a CPU whose kernels run and every sequence samples at its
    temperature alone (no top-k, no top-p). None elsewhere (target_probs then)."""
    vocab = group[0].logits.shape[-1]
    if any(c.params.filters(vocab) for c in group):
        return None
    whole = back_to_back([c.logits for c in group])
    if whole is None:
        return None
    starts = np.cumsum([0] + [len(c.logits) for c in group])
    index = torch.from_numpy(np.array([starts[s] + r for s, r in rows], dtype=np.int64))
    temperature = torch.tensor([group[s].params.temperature for s, _ in rows])
    out = kernels.softmax_weights(whole, index, temperature)
    return None if out is None else (out[0], out[1][:, None])


def probs(pieces: list[tuple[torch.Tensor, SamplingParams]]) -> torch.Tensor:
    """target_probs of each piece's rows ([rows, vocab]) under its parameters, one piece after
    another: one call for all the pieces that share temperature, top-k and top-p."""
    groups: dict[tuple, list[int]] = {}
    for i, (_, params) in enumerate(pieces):
        groups.setdefault((params.temperature, params.top_k, params.top_p), []).append(i)
    if len(groups) == 1:
        return target_probs(torch.cat([rows for rows, _ in pieces]), pieces[0][1])
    parts: list[torch.Tensor] = [torch.empty(0)] * len(pieces)
    for members in groups.values():
        rows = [pieces[i][0] for i in members]
        result = target_probs(torch.cat(rows), pieces[members[0]][1])  # [rows, vocab]
        for i, part in zip(members, result.split([r.shape[0] for r in rows]), strict=True):
            parts[i] = part
    return torch.cat(parts)


def siblings(
    p: torch.Tensor,  # [parents, vocab]: the target's distribution at each parent, as weights
    u: torch.Tensor,  # [parents, width]: a uniform per child rank
    parents: Parents,
    norm: torch.Tensor,  # [parents, 1]: the sum of each parent's weights
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sibling recursion of every parent at once. Returns passed [parents, width] (the
    i-th child passed its test, given that its elder siblings failed theirs) and each
    parent's p after all its children, unnormalised [parents, vocab].

    p is kept as weights and their sum (`norm`): a rejection takes min(p, q_i) off the
    columns of q_i's support alone (p - min(p, q_i) is max(0, p - q_i) there and p elsewhere)
    and lowers the sum by what it took, so a rank costs a few [parents, support] operations,
    not passes over the vocabulary; p is overwritten."""
    q, has_dist = parents.q, parents.has_dist  # [parents, support], [parents, 1]
    point = torch.zeros_like(q)
    point[:, 0] = 1.0  # a point mass on the child's token, for parents without a q
    passed = []
    for i in range(parents.children.shape[1]):
        x = parents.tokens[:, i : i + 1]  # [parents, 1]
        hit = parents.support == x  # [parents, support]
        total = q.sum(1, keepdim=True)  # [parents, 1]
        q_x = (q * hit).sum(1, keepdim=True)  # [parents, 1]
        # A child its own distribution could not have drawn is skipped: no test, no update.
        tried = parents.live[:, i : i + 1] & (~has_dist | ((q_x > 0) & (total > _EPS)))
        q_i = torch.where(has_dist, q / total.clamp_min(_EPS), point)  # [parents, support]
        q_ix = torch.where(has_dist, q_x / total.clamp_min(_EPS), 1.0)  # [parents, 1]
        passed.append(tried & (u[:, i : i + 1] * q_ix * norm < p.gather(1, x)))  # u < p/q
        ids = torch.where(has_dist, parents.support, x)  # [parents, support]
        taken = torch.minimum(p.gather(1, ids), q_i * norm)  # [parents, support], in weights
        left = norm - taken.sum(1, keepdim=True)  # [parents, 1]
        update = tried & (left > _EPS * norm)  # (the residual's mass, left / norm > EPS)
        p.scatter_add_(1, ids, torch.where(update, -taken, 0.0))
        norm = torch.where(update, left, norm)
        q = torch.where(hit & tried & has_dist, 0.0, q)  # drawn without replacement
    return torch.cat(passed, 1), p
