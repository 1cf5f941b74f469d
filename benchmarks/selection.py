"""Selection time for one step: the vectorised `select` against the plain per-node walk.

A batch of sequences, each with a draft tree and random target logits over the full vocabulary
(made so that walks go a few levels deep), is selected greedily and by sampling. "walk" is
what the verifier did before: the logits to the host, then reference_acceptance's walk, one
sequence and one node at a time; "select" is one `select` call where the logits are.

    python -m benchmarks.selection [--device cuda] [--seqs 8] [--nodes 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.speculation.acceptance import Candidates, select
from specserve.speculation.sampling import SamplingParams, make_generator
from specserve.speculation.tree import DraftTree
from tests.reference_acceptance import walk

VOCAB = 151936
SUPPORT = 8  # tokens in a sampled node's draft distribution (the drafter's sample_support)
MODES = {
    "greedy": SamplingParams(),
    "sampling t=0.8": SamplingParams(temperature=0.8, seed=1),
    "sampling t=0.8 top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
}


def tree_of(nodes: int, gen: torch.Generator, sampled: bool) -> DraftTree:
    """Three children under the root and two under every node after it, breadth first, up to
    `nodes` nodes; sampled trees carry a draft distribution at every parent."""
    tree = DraftTree()
    frontier, width = [-1], 3
    while len(tree) < nodes:
        parent = frontier.pop(0)
        support = torch.randint(VOCAB, (SUPPORT,), generator=gen).unique()
        for token in support[:width].tolist()[: nodes - len(tree)]:
            frontier.append(tree.add(token, parent))
        if sampled:
            q = torch.rand(len(support), generator=gen)
            tree.dists[parent] = (support.tolist(), (q / q.sum()).tolist())
        width = 2
    return tree


def logits_for(tree: DraftTree, gen: torch.Generator, device: str) -> torch.Tensor:
    """[nodes + 1, vocab]: random, with the first child's token on top at most rows."""
    rows = torch.randn(len(tree) + 1, VOCAB, generator=gen)
    for node, kids in tree.children().items():
        if torch.rand((), generator=gen) < 0.8:
            rows[node + 1, tree.token_ids[kids[0]]] = 12.0
    return rows.to(device)


def batch_of(args, params: SamplingParams, seed: int) -> list[Candidates]:
    gen = torch.Generator().manual_seed(seed)
    trees = [tree_of(args.nodes, gen, not params.greedy) for _ in range(args.seqs)]
    logits = torch.cat([logits_for(t, gen, args.device) for t in trees])  # one buffer, as
    rows = logits.split([len(t) + 1 for t in trees])  # a forward pass returns them
    return [
        Candidates(t, r, params, make_generator(params, args.device))
        for t, r in zip(trees, rows, strict=True)
    ]


def walk_all(batch: list[Candidates]) -> list:
    """The verifier before: each sequence's rows to the host, its walk there (and its
    generator there too)."""
    gen = torch.Generator().manual_seed(1)
    return [walk(c.tree, c.logits.cpu(), c.params, gen) for c in batch]


def timed(fn, batch, repeats: int) -> tuple[float, list]:
    """Median milliseconds of `repeats` calls (after one warm-up), and the last result."""
    result = fn(batch)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn(batch)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{args.seqs} sequences x {args.nodes}-node trees, vocab {VOCAB}, {args.device}, "
        f"{torch.get_num_threads()} threads; median of {args.repeats} (ms)"
    )
    print(f"{'mode':28} {'walk':>9} {'select':>9} {'walk/select':>12} {'accepted':>9}")
    for name, params in MODES.items():
        batch = batch_of(args, params, seed=0)
        before, _ = timed(walk_all, batch, args.repeats)
        after, verdicts = timed(select, batch, args.repeats)
        accepted = sum(len(v.accepted) for v in verdicts) / len(verdicts)
        print(f"{name:28} {before:9.1f} {after:9.1f} {before / after:11.2f}x {accepted:9.1f}")


if __name__ == "__main__":
    main()
