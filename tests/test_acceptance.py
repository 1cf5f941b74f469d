"""The acceptance rule: hand-built trees for the greedy walk, statistics for sampling."""

from __future__ import annotations

import pytest
import torch

from specserve.common.tree import DraftTree
from specserve.drafter.draft_model import _gumbel_top_k
from specserve.verifier.acceptance import Verdict, accept
from specserve.verifier.sampling import SamplingParams, target_probs

V = 6
GREEDY = SamplingParams()


def one_hot_rows(argmaxes: list[int]) -> torch.Tensor:
    rows = torch.full((len(argmaxes), V), -5.0)
    for i, t in enumerate(argmaxes):
        rows[i, t] = 5.0
    return rows


def chain(tokens: list[int]) -> DraftTree:
    tree = DraftTree()
    for i, t in enumerate(tokens):
        tree.add(t, i - 1)
    return tree


def test_greedy_perfect_match_accepts_every_node_and_adds_a_bonus():
    v = accept(chain([1, 2, 3]), one_hot_rows([1, 2, 3, 4]), GREEDY, None)
    assert v.accepted == [0, 1, 2]
    assert v.tokens == [1, 2, 3, 4]


def test_greedy_first_node_mismatch_emits_the_target_token():
    v = accept(chain([1, 2, 3]), one_hot_rows([5, 2, 3, 4]), GREEDY, None)
    assert v.accepted == []
    assert v.tokens == [5]


def test_greedy_deep_branch_wins():
    tree = DraftTree()
    a = tree.add(1, -1)  # branch 1: 1 -> 2
    tree.add(2, a)
    b = tree.add(3, -1)  # branch 2: 3 -> 4 -> 5
    c = tree.add(4, b)
    d = tree.add(5, c)
    # rows: root, a, a's child, b, c, d
    v = accept(tree, one_hot_rows([3, 0, 0, 4, 5, 1]), GREEDY, None)
    assert v.accepted == [b, c, d]
    assert v.tokens == [3, 4, 5, 1]


def test_empty_tree_is_plain_decoding():
    assert accept(DraftTree(), one_hot_rows([2]), GREEDY, None).tokens == [2]
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    v = accept(DraftTree(), torch.tensor([[0.0, 0, 0, 9, 0, 0]]), params, gen)
    assert v.accepted == [] and len(v.tokens) == 1


# --- sampling: the emitted token must be distributed as the target's p -------------------

P_LOGITS = torch.log(torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]))
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # deliberately unlike p
TRIALS = 20000
CHI2_CRITICAL = 25.7  # chi-square, 5 degrees of freedom, p-value 1e-4


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with target probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def sampled_tree(gen: torch.Generator, siblings: int, with_dist: bool) -> DraftTree:
    tree = DraftTree()
    for token in _gumbel_top_k(Q, siblings, gen):
        tree.add(token, -1)
    if with_dist:
        tree.dists[-1] = (list(range(V)), Q.tolist())
    return tree


def first_tokens(sampler, params: SamplingParams, siblings: int, with_dist=True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(V)
    for _ in range(TRIALS):
        tree = sampled_tree(gen, siblings, with_dist)
        rows = P_LOGITS.repeat(len(tree) + 1, 1)
        counts[sampler(tree, rows, params, gen).tokens[0]] += 1
    return counts


@pytest.mark.parametrize("siblings", [0, 1, 3])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "t0.7-topk4", "t1.3-topp0.8"],
)
def test_sampling_from_a_tree_matches_the_target_distribution(params, siblings):
    counts = first_tokens(accept, params, siblings)
    assert chi_square(counts, target_probs(P_LOGITS, params)) < CHI2_CRITICAL


def test_deterministic_siblings_are_point_masses_and_stay_exact():
    params = SamplingParams(temperature=1.0)
    counts = first_tokens(accept, params, 3, with_dist=False)
    assert chi_square(counts, target_probs(P_LOGITS, params)) < CHI2_CRITICAL


def naive_accept(tree, logits, params, gen):
    """A wrong sampler: on rejection it draws from p instead of the residual distribution."""
    p = target_probs(logits[0], params)
    token = tree.token_ids[0]
    if torch.rand((), generator=gen) < min(1.0, float(p[token] / Q[token])):
        return Verdict([0], [token])
    return accept(DraftTree(), logits[:1], params, gen)


def test_the_check_catches_a_biased_sampler():
    params = SamplingParams(temperature=1.0)
    counts = first_tokens(naive_accept, params, 1)
    assert chi_square(counts, target_probs(P_LOGITS, params)) > 10 * CHI2_CRITICAL


def test_seeded_acceptance_is_reproducible():
    params = SamplingParams(temperature=1.0, seed=5)

    def run():
        gen = torch.Generator().manual_seed(5)
        return [
            accept(sampled_tree(gen, 3, True), P_LOGITS.repeat(4, 1), params, gen).tokens
            for _ in range(50)
        ]

    assert run() == run()
