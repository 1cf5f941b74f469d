"""Which draft tokens the target keeps: a pure function of (tree, target logits, sampling).

Terms (as in vLLM's rejection sampler and Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; the tree form is SpecInfer, Miao et al. 2024, and
recursive rejection sampling over siblings drawn without replacement is Jeon et al. 2024,
"Recursive Speculative Decoding"):

- accepted: draft nodes on the path the target agrees with, from the root down.
- recovered: on rejection, a token drawn from the residual distribution norm(max(0, p - q)).
- bonus: when the walk ends at a node whose children are all rejected or that has none, one
  more token from the target (the recovered one, or a plain draw from p).

Greedy: follow the child whose token is the target's argmax; the bonus is that argmax.
Sampling: at each node, siblings x_1..x_k (drawn from q without replacement, in draw order)
are tried in turn; x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), where q_i is q
with x_1..x_{i-1} removed and renormalised, and on rejection p_{i+1} = norm(max(0, p_i - q_i)).
A node without a draft distribution has deterministic children: q_i is a point mass on x_i.
Either way the emitted token is distributed exactly as p, so the output is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.tree import DraftTree
from .sampling import SamplingParams, target_probs

_EPS = 1e-12


@dataclass
class Verdict:
    accepted: list[int]  # node indices of the accepted path, root first
    tokens: list[int]  # the accepted nodes' tokens, then the bonus token


def accept(
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
            chosen, bonus = _rejection_walk(tree, node, kids, target_probs(row, params), generator)
        if chosen is None:
            return Verdict(accepted, [tree.token_ids[n] for n in accepted] + [bonus])
        accepted.append(chosen)
        node = chosen


def _rejection_walk(tree, node, kids, p, generator) -> tuple[int | None, int]:
    """Tries node's children in order; returns (accepted child or None, recovered token)."""
    dist = tree.dists.get(node)
    q = None
    if dist is not None:
        q = torch.zeros_like(p)
        q[torch.tensor(dist[0], dtype=torch.long)] = torch.tensor(dist[1], dtype=p.dtype)
    for child in kids:
        token = tree.token_ids[child]
        if q is None:
            q_i = torch.zeros_like(p)
            q_i[token] = 1.0
        else:
            total = q.sum()
            if q[token] <= 0 or total <= _EPS:
                continue  # a child its own distribution could not have drawn: ignore it
            q_i = q / total
        u = torch.rand((), generator=generator, device=p.device)
        if u * q_i[token] < p[token]:  # u < p/q, without dividing
            return child, token
        residual = torch.clamp(p - q_i, min=0.0)
        mass = residual.sum()
        if mass > _EPS:
            p = residual / mass
        if q is not None:
            q = q.clone()
            q[token] = 0.0  # drawn without replacement
    return None, int(torch.multinomial(p, 1, generator=generator))
