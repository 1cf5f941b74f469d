"""Speculative decoding is lossless: the proposers, tree verification and acceptance together
give the target's greedy output token for token, for every tree shape, size and batch size."""

from __future__ import annotations

import itertools

import pytest
import torch

from helpers import make_sequence
from specserve.engine.flat_model import FlatModel
from specserve.speculation.acceptance import accept
from specserve.speculation.draft_model import DraftModelProposer
from specserve.speculation.hybrid import HybridProposer
from specserve.speculation.ngram import NgramProposer
from specserve.speculation.proposer import DraftJob, TreeShape
from specserve.speculation.sampling import SamplingParams, make_generator
from specserve.speculation.suffix import SharedOutputs, SuffixProposer
from specserve.verifier.reference import hf_greedy
from specserve.verifier.runner import ModelRunner
from speculative_decoder import PROMPTS, speculative_greedy


@pytest.fixture(scope="module")
def references(tiny_model, tokenizer):
    return {i: hf_greedy(tiny_model, p, 40) for i, p in enumerate(PROMPTS)}


def draft_model_proposer(draft, shape):
    return DraftModelProposer(FlatModel(draft), shape)


PROPOSERS = {
    "draft-same": lambda target, draft, shape: draft_model_proposer(target, shape),
    "draft-other": lambda target, draft, shape: draft_model_proposer(draft, shape),
    "ngram": lambda target, draft, shape: NgramProposer(shape),
    "suffix": lambda target, draft, shape: suffix_proposer(),
    "hybrid": lambda target, draft, shape: HybridProposer(
        suffix_proposer(), draft_model_proposer(draft, shape)
    ),
}


def suffix_proposer() -> SuffixProposer:
    return SuffixProposer(SharedOutputs(tokens_per_tenant=4096, tenants=4))


SHAPES = {
    "chain": TreeShape(max_depth=64, branching=1, width=1),
    "tree": TreeShape(max_depth=8, branching=3, width=4),
}


BUDGETS, BATCHES = [1, 2, 5, 16, 64], [1, 3, 8]


def grid() -> list:
    """Every (proposer, shape, budget, batch). `make test` runs 25 of the 150: each
    proposer with each budget, the shape and batch size chosen so that every pair of values of
    any two of the four factors appears at least once (pairwise coverage: a fault that needs
    two factors to show is caught); the rest are marked long (`make test-long`)."""
    names, shapes = list(PROPOSERS), list(SHAPES)
    pairwise = {
        (p, shapes[(i + j) % 2], b, BATCHES[(i + 2 * j) % 3])
        for i, p in enumerate(names)
        for j, b in enumerate(BUDGETS)
    }
    return [
        pytest.param(
            *case,
            id="-".join(map(str, case)),
            marks=() if case in pairwise else pytest.mark.long,
        )
        for case in itertools.product(names, shapes, BUDGETS, BATCHES)
    ]


@pytest.mark.parametrize("proposer,shape,budget,batch", grid())
def test_greedy_output_is_the_targets(
    tiny_model, tiny_draft, tokenizer, references, proposer, shape, budget, batch
):
    prop = PROPOSERS[proposer](tiny_model, tiny_draft, SHAPES[shape])
    prompts = PROMPTS[:batch]
    outputs, steps = speculative_greedy(
        tiny_model, prop, prompts, 40, budget, tokenizer.eos_token_id
    )
    for i, out in enumerate(outputs):
        assert out == references[i]
    if proposer == "draft-same" and shape == "chain" and budget >= 5:  # a perfect draft
        assert steps < max(len(o) for o in outputs) / 2


@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_outputs_learned_across_requests_keep_greedy_exact_and_cut_steps(
    tiny_model, tiny_draft, tokenizer, references, proposer
):
    """The same prompts again, with the first round's outputs in the tenant's index: every
    output is still the target's, and the second round takes fewer steps."""
    prop = PROPOSERS[proposer](tiny_model, tiny_draft, SHAPES["tree"])
    eos = tokenizer.eos_token_id
    first, first_steps = speculative_greedy(tiny_model, prop, PROMPTS[:3], 40, 32, eos)
    again, again_steps = speculative_greedy(tiny_model, prop, PROMPTS[:3], 40, 32, eos)
    for i in range(3):
        assert first[i] == again[i] == references[i]
    assert again_steps < first_steps
    assert prop.shared.tokens() > 0 if proposer == "suffix" else prop.suffix.shared.tokens() > 0


def test_hybrid_stops_taking_suffix_trees_that_do_not_come_true_for_its_sequence(tiny_draft):
    """Two sequences with the same history, whose suffix tree copies what followed it before:
    where the target keeps copying, the hybrid keeps proposing that tree; where the target
    goes elsewhere every step (the tree held none of it), the sequence's own record of its
    suffix trees turns it to the draft model, though the tree scores as high as the first."""
    hybrid = HybridProposer(suffix_proposer(), draft_model_proposer(tiny_draft, SHAPES["chain"]))
    part = list(range(300, 340))
    history = {"copies": part + part[:5], "strays": part + part[:5]}
    chosen: dict[str, list[bool]] = {name: [] for name in history}
    for step in range(8):
        jobs = [DraftJob(name, tokens, 4, deep_budget=16) for name, tokens in history.items()]
        for job, tree in zip(jobs, hybrid.propose(jobs), strict=True):
            chosen[job.seq_id].append(len(tree) > 4)  # (the chain alone holds 4 nodes at most)
        at = 5 + 4 * step  # the copy goes on; the other emits a new token, then the same 5
        history["copies"] += part[at : at + 4]
        history["strays"] += [500 + step, *part[:5]]
    assert all(chosen["copies"])
    assert chosen["strays"][0] and not any(chosen["strays"][-3:])


def test_a_winning_suffix_tree_and_the_chain_go_as_one_tree_for_greedy_steps(tiny_draft):
    """A sequence whose history repeats: its suffix tree wins. With a draft-model budget, a
    greedy step proposes the chain and the suffix tree merged (every path of both, within the
    larger budget); a sampling step, or one without that budget, the suffix tree alone."""
    hybrid = HybridProposer(suffix_proposer(), draft_model_proposer(tiny_draft, SHAPES["chain"]))
    part = list(range(300, 340))
    history = part + part[:5]
    drafter = draft_model_proposer(tiny_draft, SHAPES["chain"])
    (chain,) = drafter.propose([DraftJob("c", history, 4)])
    suffix, _ = suffix_proposer().propose_one(DraftJob("s", history, 4, deep_budget=16))
    (both,) = hybrid.propose([DraftJob("g", history, 4, deep_budget=16)])
    assert not both.model_free and len(both) <= 16
    paths = {tuple(both.path(n)) for n in range(len(both))}
    assert tuple(chain.path(len(chain) - 1)) in paths
    assert tuple(suffix.path(len(suffix) - 1)) in paths  # the copy
    (sampled,) = hybrid.propose([DraftJob("t", history, 4, 0.8, 1, deep_budget=16)])
    (unbudgeted,) = hybrid.propose([DraftJob("u", history, 0, deep_budget=16)])
    for alone in (sampled, unbudgeted):
        assert alone.model_free and alone.token_ids == suffix.token_ids


def test_draft_cache_resyncs_after_a_rollback(tiny_model):
    """A drafter told a shorter or different history drafts as if it started fresh."""
    shape = SHAPES["tree"]
    warm = draft_model_proposer(tiny_model, shape)
    history = PROMPTS[1] + [11, 12, 13, 14]
    warm.propose([DraftJob("s", history, 8)])
    rolled = PROMPTS[1] + [11, 99]
    again = warm.propose([DraftJob("s", rolled, 8)])[0]
    fresh = draft_model_proposer(tiny_model, shape).propose([DraftJob("s", rolled, 8)])[0]
    assert again.token_ids == fresh.token_ids and again.parents == fresh.parents


def test_chain_draft_of_the_target_itself_is_its_greedy_continuation(tiny_model):
    chain = draft_model_proposer(tiny_model, SHAPES["chain"])
    (tree,) = chain.propose([DraftJob("s", PROMPTS[0], 6)])
    assert tree.parents == [-1, 0, 1, 2, 3, 4]
    assert tree.token_ids == hf_greedy(tiny_model, PROMPTS[0], 6)


def test_chains_of_a_batch_match_greedy_continuations_and_the_tree_growth(tiny_draft):
    """Chains are drafted level by level on the device (one read at the end): a greedy one is
    its sequence's greedy continuation as long as its budget; with a min_path_prob stop, and
    sampled ones beside them, the same trees (draws and q included) as the tree growth."""
    budgets = (6, 2, 4)
    jobs = [DraftJob(f"s{i}", PROMPTS[i], b) for i, b in enumerate(budgets)]
    chains = draft_model_proposer(tiny_draft, SHAPES["chain"]).propose(jobs)
    for tree, job in zip(chains, jobs, strict=True):
        assert tree.parents == list(range(-1, job.budget - 1))
        assert tree.token_ids == hf_greedy(tiny_draft, job.tokens, job.budget)
    shape = TreeShape(max_depth=6, branching=1, width=1, min_path_prob=0.2)
    sampled = [DraftJob(f"t{i}", PROMPTS[3 + i], 5, temperature=0.9, seed=i) for i in range(2)]
    for batch in (jobs, jobs + sampled):
        chains = draft_model_proposer(tiny_draft, shape).propose(batch)
        grower = draft_model_proposer(tiny_draft, shape)
        roots = grower.model.forward([grower._sync(job) for job in batch])
        trees = grower._trees(batch, [logits[-1:] for logits in roots])
        assert [(t.token_ids, t.parents) for t in chains] == [
            (t.token_ids, t.parents) for t in trees
        ]
        for chain, tree in zip(chains, trees, strict=True):  # (q rounds with the batch's shape)
            assert chain.dists.keys() == tree.dists.keys()
            for node, (ids, probs) in chain.dists.items():
                assert ids == tree.dists[node][0]
                assert probs == pytest.approx(tree.dists[node][1], abs=1e-6)


def test_sampled_trees_carry_the_distribution_their_children_came_from(tiny_model):
    prop = draft_model_proposer(tiny_model, SHAPES["tree"])
    (tree,) = prop.propose([DraftJob("s", PROMPTS[2], 12, temperature=0.8, seed=3)])
    assert 0 < len(tree) <= 12
    tree.validate(tiny_model.config.vocab_size)
    for node, kids in tree.children().items():
        ids, probs = tree.dists[node]
        assert abs(sum(probs) - 1) < 1e-4
        assert all(tree.token_ids[k] in ids for k in kids)
        assert len({tree.token_ids[k] for k in kids}) == len(kids)  # without replacement
    (same,) = draft_model_proposer(tiny_model, SHAPES["tree"]).propose(
        [DraftJob("s", PROMPTS[2], 12, temperature=0.8, seed=3)]
    )
    assert same.token_ids == tree.token_ids


def test_ngram_proposes_what_followed_the_last_match():
    prop = NgramProposer(TreeShape(max_depth=4), min_ngram=2, max_ngram=3)
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    tree = prop.propose_one(history, budget=16)
    paths = {tuple(tree.path(n)) for n in range(len(tree)) if n not in tree.children()}
    assert paths == {(7, 8, 1, 2), (4, 5, 9, 1)}  # what followed both earlier matches
    assert len(prop.propose_one(history, budget=3)) == 3
    assert len(prop.propose_one([1, 2, 3, 4], budget=8)) == 0


def test_sampling_with_speculation_keeps_seeded_requests_reproducible(tiny_model, tiny_draft):
    def run():
        torch.manual_seed(0)
        prop = draft_model_proposer(tiny_draft, SHAPES["tree"])
        runner = ModelRunner(FlatModel(tiny_model))
        seq = make_sequence(PROMPTS[0], max_tokens=30)
        params = SamplingParams(temperature=1.0, seed=11)
        gen = make_generator(params, runner.model.device)  # where the logits stay
        while len(seq.output_ids) < 30:
            seed = int(torch.randint(2**62, (), generator=gen, device=gen.device))
            (tree,) = prop.propose([DraftJob("s", seq.all_ids, 6, 1.0, seed)])
            (logits,) = runner.verify([seq], [tree])
            verdict = accept(tree, logits, params, gen)
            runner.commit(seq, tree, verdict.accepted)
            seq.extend(verdict.tokens, lambda s: len(s.output_ids) >= 30)
        return seq.output_ids

    assert run() == run()


def test_a_draft_model_times_its_levels_and_catch_up_and_keeps_nothing_of_it(tiny_model):
    """The drafter's timing at start (sent to verifiers with each stream's first answer):
    positive prices, and the scratch sequences forgotten."""
    proposer = draft_model_proposer(tiny_model, SHAPES["chain"])
    cost = proposer.timed_cost(context=32, reps=2)
    assert cost.level_seconds > 0 and cost.catch_up_seconds_per_token > 0
    assert not proposer.states
