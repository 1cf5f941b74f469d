"""The suffix proposer: matches, frequency-scored trees, depth by match length, per-tenant
outputs with their memory bound, and adversarial text kept within its bounds."""

from __future__ import annotations

import random
import time
import tracemalloc

import pytest

from specserve.speculation.proposer import DraftJob
from specserve.speculation.suffix import SharedOutputs, SuffixIndex, SuffixProposer


def paths(tree) -> set[tuple[int, ...]]:
    leaves = set(range(len(tree))) - set(tree.parents)
    return {tuple(tree.path(n)) for n in leaves}


def test_the_longest_earlier_match_gives_what_followed_it():
    index = SuffixIndex()
    history = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 7, 8, 0, 2, 3, 4]
    index.extend(history)
    match, ends = index.occurrences(history, max_match=32, max_candidates=64)
    assert match == 3 and sorted(ends) == [3, 9]  # "2 3 4" twice before; the end is itself
    history = [*history[:-3], 1, 2, 3, 4]
    index = SuffixIndex()
    index.extend(history)
    match, ends = index.occurrences(history, 32, 64)
    assert (match, ends) == (4, [3])  # "1 2 3 4" is longer than "2 3 4"


def test_trees_branch_by_frequency_and_score_their_expected_acceptance():
    index = SuffixIndex()
    for continuation in ([10, 11], [10, 11], [10, 12], [20, 21]):
        index.add_document([5, 6, *continuation])
    match, ends = index.occurrences([7, 5, 6], 32, 64)
    assert match == 2 and len(ends) == 4
    tree, score = index.grow(ends, depth=8, budget=16, min_token_prob=0.1, match=2)
    assert paths(tree) == {(10, 11), (10, 12), (20, 21)}
    assert tree.token_ids[0] == 10  # the most frequent first
    # 10: 3/4, 10 11: 2/4, 10 12: 1/4, 20: 1/4, 20 21: 1/4; after a match of 2, a first token
    # counts 2/3 of its share, a second 2/4
    assert abs(score - ((0.75 + 0.25) * 2 / 3 + (0.5 + 0.25 + 0.25) * 2 / 4)) < 1e-9
    # Each node's term is its score (what the verifier cuts the tree by), and any first
    # nodes are the best tree of that many.
    assert sorted(tree.scores) == pytest.approx(sorted([0.5, 0.25, 0.125, 1 / 6, 0.125]))
    assert abs(sum(tree.scores) - score) < 1e-9
    small, _ = index.grow(ends, depth=8, budget=2, min_token_prob=0.1, match=2)
    assert small.token_ids == [10, 11]  # best-first: the likeliest nodes within the budget
    assert tree.prefix(2).token_ids == small.token_ids and tree.prefix(2).scores == small.scores
    rare, _ = index.grow(ends, depth=8, budget=16, min_token_prob=0.4, match=2)
    assert paths(rare) == {(10, 11)}  # children below 0.4 of their parent's matches are cut


def test_depth_follows_the_match_length():
    copied = list(range(100, 160))
    prop = SuffixProposer(max_depth=64, depth_factor=2.0, min_match=2)
    short = [*copied, 7, 100, 101]  # matches 2 tokens: 4 deep
    tree, _ = prop.propose_one(DraftJob("a", short, 64))
    assert tree.model_free and len(tree) == 4 and tree.token_ids == copied[2:6]
    long = [*copied, 7, *copied[:20]]  # matches 20 tokens: 40 deep
    tree, _ = prop.propose_one(DraftJob("b", long, 64))
    assert tree.token_ids == copied[20:60]
    tree, _ = prop.propose_one(DraftJob("b", long, 8, deep_budget=0))
    assert len(tree) == 0  # the model-free budget is deep_budget


def test_one_token_seen_before_is_a_match_by_default():
    """A single earlier occurrence of the last token drafts what followed it, as deep as the
    match allows (depth_factor x 1); `min_match: 2` asks for two matched tokens. On the
    acceptance replay one token more than paid for its shallow trees (benchmarks/README)."""
    history = [5, 10, 11, 12, 7, 5]
    tree, score = SuffixProposer().propose_one(DraftJob("a", history, 64))
    assert tree.token_ids == [10, 11] and abs(score - (1 / 2 + 1 / 3)) < 1e-9
    tree, _ = SuffixProposer(min_match=2).propose_one(DraftJob("b", history, 64))
    assert len(tree) == 0


def test_a_tenants_outputs_shape_only_its_own_drafts():
    prop = SuffixProposer(SharedOutputs(tokens_per_tenant=1000, tenants=8))
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    prop.learn("acme", [1, 2, *answer], 2)
    prompt = [9, 9, 40, 41, 42]
    tree, _ = prop.propose_one(DraftJob("r1", prompt, 16, tenant="acme"))
    assert tree.token_ids[:5] == answer[3:]
    other, _ = prop.propose_one(DraftJob("r2", prompt, 16, tenant="globex"))
    assert len(other) == 0
    shared = SuffixProposer(SharedOutputs(1000, 8, scope="global"))
    shared.learn("acme", answer, 0)
    tree, _ = shared.propose_one(DraftJob("r3", prompt, 16, tenant="globex"))
    assert tree.token_ids[:5] == answer[3:]


def test_a_rolled_back_history_is_indexed_afresh():
    prop = SuffixProposer()
    prop.propose_one(DraftJob("s", [1, 2, 3, 1, 2, 3, 1, 2], 8))
    tree, _ = prop.propose_one(DraftJob("s", [5, 6, 7, 5, 6], 8))
    assert tree.token_ids[:1] == [7]
    assert prop.requests["s"].tokens == [5, 6, 7, 5, 6]


def test_shared_outputs_stay_within_their_bound_and_evict_the_oldest():
    shared = SharedOutputs(tokens_per_tenant=500, tenants=3)
    rng = random.Random(0)
    for i in range(200):
        shared.add(f"t{i % 5}", [rng.randrange(50) for _ in range(rng.randrange(1, 120))])
        assert shared.tokens() <= 3 * 500
        for index in shared.indices.values():
            assert len(index) <= 500 and len(index.tokens) <= 2 * 500  # until compacted
            ends = [[e] if isinstance(e, int) else e for e in index.ends.values()]
            entries = sum(map(len, ends))
            assert entries <= 3 * len(index.tokens)  # one per key length per token, no more
            assert all(index.base <= p < index.end for e in ends for p in e)
    assert list(shared.indices) == ["t2", "t3", "t4"]  # the least recent tenants went
    recent = [7, 7, 8, 8, 9, 9]
    shared.add("t4", recent)
    match, ends = shared.get("t4").occurrences([1, 7, 7, 8, 8], 32, 64)
    assert match >= 4 and shared.get("t4").at(ends[0] + 1) == 9


def test_adversarial_repetition_keeps_drafting_fast_and_memory_bounded():
    """100k near-identical suffixes: a step's work is bounded by max_candidates and the
    budget, not by how often the suffix occurred."""
    rng = random.Random(1)
    text = []
    for _ in range(12_500):
        text += [1, 2, 3, 4, 5, 6, 7, rng.randrange(8, 12)]
    shared = SharedOutputs(tokens_per_tenant=20_000, tenants=2)
    prop = SuffixProposer(shared)
    for chunk in range(0, len(text), 10_000):
        prop.learn("t", text[chunk : chunk + 10_000], 0)
    assert len(shared.get("t")) <= 20_000
    job = DraftJob("s", text, 64, tenant="t")
    prop.propose_one(job)  # indexes the 100k-token history once
    started = time.perf_counter()
    for _ in range(20):
        tree, score = prop.propose_one(job)
    per_step = (time.perf_counter() - started) / 20
    assert 0 < len(tree) <= 64 and score > 0
    # Not a speed target: about 1 ms here; an unbounded scan of the 100k matches takes seconds.
    assert per_step < 0.25, f"{per_step * 1000:.1f} ms per step"


def test_an_index_holds_a_few_hundred_bytes_a_token():
    """What the memory bound means in bytes: 50,000 tokens of varied text."""
    rng = random.Random(2)
    tokens = [rng.randrange(150_000) for _ in range(50_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = SuffixIndex(max_tokens=50_000)
    index.extend(tokens)
    per_token = (tracemalloc.get_traced_memory()[0] - before) / len(tokens)
    tracemalloc.stop()
    assert len(index) == 50_000
    assert per_token < 350, f"{per_token:.0f} bytes a token"


def test_a_longer_match_scores_its_copy_higher():
    """The same continuation, seen once, after a match of 1 token and of 12: the score (the
    expected accepted tokens the hybrid proposer weighs) trusts the longer match more at every
    depth, and neither as certain (a share of 1 at each of its nodes)."""
    copied = list(range(100, 140))
    prop = SuffixProposer(max_depth=4)
    _, short = prop.propose_one(DraftJob("a", [*copied, 7, 100], 64))  # matches "100": 2 deep
    _, long = prop.propose_one(DraftJob("b", [*copied, 7, *copied[:12]], 64))  # 12: 4 deep
    assert abs(short - (1 / 2 + 1 / 3)) < 1e-9
    assert abs(long - sum(12 / (12 + j) for j in range(1, 5))) < 1e-9 and long < 4
