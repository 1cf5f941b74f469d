"""The acceptance rule as a plain walk from the root, one node at a time: the oracle the
vectorised `select` is checked against (and the "before" of benchmarks/selection.py).

Greedy: follow the first child whose token is the target's argmax; the bonus is that argmax.
Sampling: recursive rejection sampling over each node's children in draw order (the terms
are defined in specserve.speculation.acceptance)."""

from __future__ import annotations

import torch

from specserve.speculation.acceptance import Verdict
from specserve.speculation.sampling import SamplingParams, target_probs
from specserve.speculation.tree import DraftTree

EPS = 1e-12


def walk(
    tree: DraftTree,
    logits: torch.Tensor,  # [nodes + 1, vocab]: row 0 after the root, row i+1 after node i
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    children = tree.children()
    accepted: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        kids = children.get(node, [])
        if params.greedy:
            best = int(torch.argmax(row))
            chosen = next((c for c in kids if tree.token_ids[c] == best), None)
            bonus = best
        else:
            chosen, bonus = siblings(tree, node, kids, target_probs(row, params), generator)
        if chosen is None:
            return Verdict(accepted, [tree.token_ids[n] for n in accepted] + [bonus])
        accepted.append(chosen)
        node = chosen


def siblings(tree, node, kids, p, generator) -> tuple[int | None, int]:
    """Tries node's children in order; returns (accepted child or None, recovered token)."""
    dist = tree.dists.get(node)
    q = None
    if dist is not None:
        q = torch.zeros_like(p)
        q[torch.tensor(dist[0], dtype=torch.long, device=p.device)] = torch.tensor(
            dist[1], dtype=p.dtype, device=p.device
        )
    for child in kids:
        token = tree.token_ids[child]
        if q is None:
            q_i = torch.zeros_like(p)
            q_i[token] = 1.0
        else:
            total = q.sum()
            if q[token] <= 0 or total <= EPS:
                continue  # a child its own distribution could not have drawn: ignore it
            q_i = q / total
        u = torch.rand((), generator=generator, device=p.device)
        if u * q_i[token] < p[token]:  # u < p/q, without dividing
            return child, token
        residual = torch.clamp(p - q_i, min=0.0)
        mass = residual.sum()
        if mass > EPS:
            p = residual / mass
        if q is not None:
            q = q.clone()
            q[token] = 0.0  # drawn without replacement
    return None, int(torch.multinomial(p, 1, generator=generator))
