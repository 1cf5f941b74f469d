"""The acceptance rule: hand-built trees for the greedy walk, the plain walk of
reference_acceptance as the oracle on random trees, statistics for sampling. Logits and the
sequences' generators are on the tests' device (SPECSERVE_TEST_DEVICE), where the verifier
selects; trees are drawn on the host, as drafters draw them."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_KERNELS, DEVICE
from reference_acceptance import walk
from specserve.engine import kernels
from specserve.speculation import rejection
from specserve.speculation.acceptance import (
    Candidates,
    NonFinite,
    Verdict,
    accept,
    select,
    select_on_device,
    select_walked,
)
from specserve.speculation.draft_model import gumbel_order
from specserve.speculation.sampling import SamplingParams, target_probs
from specserve.speculation.tree import DraftTree

V = 6
GREEDY = SamplingParams()


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these tensors are tiny, and on a busy machine a second thread only
    waits (topk over [50, 6] rows: 60 us on one thread, milliseconds on two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def one_hot_rows(argmaxes: list[int]) -> torch.Tensor:
    rows = torch.full((len(argmaxes), V), -5.0)
    for i, t in enumerate(argmaxes):
        rows[i, t] = 5.0
    return rows.to(DEVICE)


def device_generator(seed: int) -> torch.Generator:
    """A sequence's random source, where its logits are (as sampling.make_generator)."""
    return torch.Generator(DEVICE).manual_seed(seed)


def chain(tokens: list[int]) -> DraftTree:
    tree = DraftTree()
    for i, t in enumerate(tokens):
        tree.add(t, i - 1)
    return tree


def branches() -> DraftTree:
    tree = DraftTree()
    a = tree.add(1, -1)  # branch 1: 1 -> 2
    tree.add(2, a)
    b = tree.add(3, -1)  # branch 2: 3 -> 4 -> 5
    c = tree.add(4, b)
    tree.add(5, c)
    return tree


def test_greedy_perfect_match_accepts_every_node_and_adds_a_bonus():
    v = accept(chain([1, 2, 3]), one_hot_rows([1, 2, 3, 4]), GREEDY, None)
    assert v.accepted == [0, 1, 2]
    assert v.tokens == [1, 2, 3, 4]


def test_greedy_first_node_mismatch_emits_the_target_token():
    v = accept(chain([1, 2, 3]), one_hot_rows([5, 2, 3, 4]), GREEDY, None)
    assert v.accepted == []
    assert v.tokens == [5]


def test_greedy_stops_at_the_first_mismatch_even_if_deeper_nodes_match():
    v = accept(chain([1, 2, 3]), one_hot_rows([1, 0, 3, 4]), GREEDY, None)
    assert v.accepted == [0]  # node 2's token is its row's argmax, but node 1 was refused
    assert v.tokens == [1, 0]


def test_greedy_deep_branch_wins():
    # rows: root, a, a's child, b, c, d
    v = accept(branches(), one_hot_rows([3, 0, 0, 4, 5, 1]), GREEDY, None)
    assert v.accepted == [2, 3, 4]
    assert v.tokens == [3, 4, 5, 1]


def test_greedy_siblings_with_one_token_take_the_first():
    tree = DraftTree()
    a = tree.add(2, -1)
    b = tree.add(2, -1)
    tree.add(3, b)  # would match, under the second of the two
    v = accept(tree, one_hot_rows([2, 5, 0, 3]), GREEDY, None)
    assert (v.accepted, v.tokens) == ([a], [2, 5])


def test_empty_tree_is_plain_decoding():
    assert accept(DraftTree(), one_hot_rows([2]), GREEDY, None).tokens == [2]
    params = SamplingParams(temperature=1.0)
    rows = torch.tensor([[0.0, 0, 0, 9, 0, 0]], device=DEVICE)
    v = accept(DraftTree(), rows, params, device_generator(0))
    assert v.accepted == [] and len(v.tokens) == 1


def test_a_batch_gets_each_sequence_its_own_verdict():
    batch = [
        Candidates(chain([1, 2, 3]), one_hot_rows([1, 2, 3, 4]), GREEDY),
        Candidates(DraftTree(), one_hot_rows([5]), GREEDY),
        Candidates(branches(), one_hot_rows([3, 0, 0, 4, 5, 1]), GREEDY),
        Candidates(chain([1, 2, 3]), one_hot_rows([5, 2, 3, 4]), GREEDY),
        Candidates(branches(), one_hot_rows([1, 2, 0, 0, 0, 0]), GREEDY),
    ]
    verdicts = [(v.accepted, v.tokens) for v in select(batch)]
    assert verdicts == [
        ([0, 1, 2], [1, 2, 3, 4]),
        ([], [5]),
        ([2, 3, 4], [3, 4, 5, 1]),
        ([], [5]),
        ([0, 1], [1, 2, 0]),
    ]
    assert select([]) == []


def random_tree(gen: torch.Generator, nodes: int, vocab: int, dists: bool) -> DraftTree:
    """A tree of `nodes` nodes, each under a random earlier node or the root, with tokens
    from a small vocabulary (siblings may repeat one); some nodes carry a draft distribution."""
    tree = DraftTree()
    for i in range(nodes):
        parent = int(torch.randint(-1, i, (), generator=gen))
        tree.add(int(torch.randint(vocab, (), generator=gen)), parent)
    for node, kids in tree.children().items():
        if dists and torch.rand((), generator=gen) < 0.5:
            q = torch.rand(vocab, generator=gen) * (torch.rand(vocab, generator=gen) < 0.7)
            for kid in kids:  # a distribution its children could come from
                q[tree.token_ids[kid]] += 0.1
            support = torch.nonzero(q).flatten()
            tree.dists[node] = (support.tolist(), (q[support] / q.sum()).tolist())
    return tree


def random_rows(gen: torch.Generator, tree: DraftTree, vocab: int) -> torch.Tensor:
    """Random logits whose argmax is, most of the time, the token of one of the row's node's
    children (so walks go deep)."""
    rows = torch.randn(len(tree) + 1, vocab, generator=gen)
    children = tree.children()
    for node in range(-1, len(tree)):
        kids = children.get(node, [])
        if kids and torch.rand((), generator=gen) < 0.8:
            kid = kids[int(torch.randint(len(kids), (), generator=gen))]
            rows[node + 1, tree.token_ids[kid]] = 10.0
    return rows.to(DEVICE)


def test_select_matches_the_plain_walk_on_random_trees():
    """Greedy, and sampling with top_k=1 (a point mass: the walk is deterministic), in batches
    that mix them, against the walk one sequence at a time."""
    gen, draws = torch.Generator().manual_seed(7), device_generator(7)
    vocab, deep = 8, 0
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=1)]
    for _ in range(60):
        batch = []
        for _ in range(int(torch.randint(1, 7, (), generator=gen))):
            tree = random_tree(gen, int(torch.randint(0, 17, (), generator=gen)), vocab, True)
            kind = params[int(torch.randint(2, (), generator=gen))]
            batch.append(Candidates(tree, random_rows(gen, tree, vocab), kind, draws))
        for c, verdict in zip(batch, select(batch), strict=True):
            assert verdict == walk(c.tree, c.logits, c.params, draws)
            deep += len(verdict.accepted) >= 2
    assert deep > 50  # not only trivial walks


# --- sampling: the emitted token must be distributed as the target's p -------------------

P_LOGITS = torch.log(torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05]))
ROWS = P_LOGITS.to(DEVICE)  # every target row of the sampling tests
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # deliberately unlike p
TRIALS = 20000
BATCH = 50  # sequences selected together
CHI2_CRITICAL = 25.7  # chi-square, 5 degrees of freedom, p-value 1e-4


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with target probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def gumbel_top_k(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """One distribution's k draws in draw order, as the draft model draws them."""
    uniforms = torch.rand(probs.shape, generator=generator)
    return gumbel_order(probs[None], k, uniforms[None])[0].tolist()


def sampled_tree(gen: torch.Generator, siblings: int, with_dist: bool) -> DraftTree:
    tree = DraftTree()
    for token in gumbel_top_k(Q, siblings, gen):
        tree.add(token, -1)
    if with_dist:
        tree.dists[-1] = (list(range(V)), Q.tolist())
    return tree


def in_one_buffer(trees: list[DraftTree]) -> list[torch.Tensor]:
    """Each tree's rows (every one P) as the forward pass leaves them: views of one buffer,
    back to back (so that, on a CPU, sampling reads them through the kernels in place)."""
    sizes = [len(t) + 1 for t in trees]
    return list(ROWS.repeat(sum(sizes), 1).split(sizes))


def first_tokens(sampler, params: SamplingParams, siblings: int, with_dist=True) -> torch.Tensor:
    """The first emitted token of TRIALS trials, run BATCH sequences to a `sampler` call."""
    gen, draws = torch.Generator().manual_seed(1234), device_generator(1234)
    counts = torch.zeros(V)
    for _ in range(TRIALS // BATCH):
        trees = [sampled_tree(gen, siblings, with_dist) for _ in range(BATCH)]
        batch = [
            Candidates(t, rows, params, draws)
            for t, rows in zip(trees, in_one_buffer(trees), strict=True)
        ]
        for verdict in sampler(batch):
            counts[verdict.tokens[0]] += 1
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
    counts = first_tokens(select, params, siblings)
    assert chi_square(counts, target_probs(P_LOGITS, params)) < CHI2_CRITICAL


def test_deterministic_siblings_are_point_masses_and_stay_exact():
    params = SamplingParams(temperature=1.0)
    counts = first_tokens(select, params, 3, with_dist=False)
    assert chi_square(counts, target_probs(P_LOGITS, params)) < CHI2_CRITICAL


def naive_select(batch: list[Candidates]) -> list[Verdict]:
    """A wrong sampler: on rejection it draws from p instead of the residual distribution."""
    verdicts = []
    for c in batch:
        p = target_probs(c.logits[0], c.params)
        token = c.tree.token_ids[0]
        u = torch.rand((), generator=c.generator, device=p.device)
        if u < min(1.0, float(p[token]) / float(Q[token])):
            verdicts.append(Verdict([0], [token]))
        else:
            verdicts.append(accept(DraftTree(), c.logits[:1], c.params, c.generator))
    return verdicts


def test_the_check_catches_a_biased_sampler():
    params = SamplingParams(temperature=1.0)
    counts = first_tokens(naive_select, params, 1)
    assert chi_square(counts, target_probs(P_LOGITS, params)) > 10 * CHI2_CRITICAL


def two_level_tree(gen: torch.Generator) -> DraftTree:
    """Three children of the root drawn from Q, each with two children: drawn from Q under
    the first two, deterministic (point masses) under the third."""
    tree = DraftTree()
    tree.dists[-1] = (list(range(V)), Q.tolist())
    for rank, token in enumerate(gumbel_top_k(Q, 3, gen)):
        node = tree.add(token, -1)
        for child in gumbel_top_k(Q, 2, gen):
            tree.add(child, node)
        if rank < 2:
            tree.dists[node] = (list(range(V)), Q.tolist())
    return tree


def test_sampling_two_levels_deep_matches_the_target_distribution():
    """Every row is P, so the first two emitted tokens must be independent draws from p."""
    params = SamplingParams(temperature=1.0)
    gen, draws = torch.Generator().manual_seed(99), device_generator(99)
    counts = torch.zeros(V, V)
    deep = 0
    for _ in range(TRIALS // BATCH):
        trees = [two_level_tree(gen) for _ in range(BATCH)]
        batch = [
            Candidates(t, rows, params, draws)
            for t, rows in zip(trees, in_one_buffer(trees), strict=True)
        ]
        verdicts = select(batch)
        short = [v for v in verdicts if len(v.tokens) == 1]  # their next step has no tree
        rest = select([Candidates(DraftTree(), ROWS[None], params, draws) for _ in short])
        for verdict, more in zip(short, rest, strict=True):
            verdict.tokens += more.tokens
        for verdict in verdicts:
            counts[verdict.tokens[0], verdict.tokens[1]] += 1
            deep += len(verdict.accepted) == 2
    p = target_probs(P_LOGITS, params)
    stat = chi_square(counts.flatten(), (p[:, None] * p[None, :]).flatten())
    p_value = float(torch.special.gammaincc(torch.tensor(35 / 2), torch.tensor(stat / 2)))
    assert p_value > 1e-4
    assert deep > TRIALS // 20  # walks went through both levels


def test_seeded_selection_is_reproducible_and_its_own():
    """Same seeds, same verdicts; and a sequence's verdicts do not depend on the others
    selected with it (each draws from its own generator)."""
    params = SamplingParams(temperature=1.0, seed=5)
    trees = [two_level_tree(torch.Generator().manual_seed(s)) for s in range(40)]

    def run(seeds: list[int]) -> list[list[list[int]]]:
        gens = [device_generator(s) for s in seeds]
        steps = []
        for tree in trees:
            rows = ROWS.repeat(len(tree) + 1, 1)
            batch = [Candidates(tree, rows, params, g) for g in gens]
            steps.append([v.tokens for v in select(batch)])
        return steps

    together = run([5, 6, 7])
    assert together == run([5, 6, 7])
    assert [step[0] for step in together] == [step[0] for step in run([5])]
    assert [step[0] for step in together] != [step[1] for step in together]


def test_sampling_with_suffix_trees_matches_the_target_distribution():
    """The suffix proposer's trees (point masses, branched by frequency, two levels here)
    keep sampling exact: the first two emitted tokens are independent draws from p."""
    from specserve.speculation.proposer import DraftJob
    from specserve.speculation.suffix import SharedOutputs, SuffixProposer

    proposer = SuffixProposer(SharedOutputs(1000, 1), min_match=1, min_token_prob=0.0)
    for first, second in [(0, 1), (0, 2), (3, 1), (4, 5), (0, 1)]:
        proposer.learn("", [5, first, second], 1)
    tree, _ = proposer.propose_one(DraftJob("s", [2, 5], 16))
    assert len(tree) > 4 and max(tree.depths()) == 1 and len(tree.children()[-1]) == 3
    params = SamplingParams(temperature=1.0)
    draws = device_generator(7)
    counts = torch.zeros(V, V)
    rows = ROWS.repeat(len(tree) + 1, 1)
    for _ in range(TRIALS // BATCH):
        verdicts = select([Candidates(tree, rows, params, draws) for _ in range(BATCH)])
        short = [v for v in verdicts if len(v.tokens) == 1]
        rest = select([Candidates(DraftTree(), ROWS[None], params, draws) for _ in short])
        for verdict, more in zip(short, rest, strict=True):
            verdict.tokens += more.tokens
        for verdict in verdicts:
            counts[verdict.tokens[0], verdict.tokens[1]] += 1
    p = target_probs(P_LOGITS, params)
    stat = chi_square(counts.flatten(), (p[:, None] * p[None, :]).flatten())
    p_value = float(torch.special.gammaincc(torch.tensor(35 / 2), torch.tensor(stat / 2)))
    assert p_value > 1e-4


ALLOWED = [0, 2, 3, 5]  # what a grammar allows at every row


def masked_first_tokens(sampler, params: SamplingParams) -> torch.Tensor:
    """first_tokens, with every row masked to ALLOWED (as constraint.masks gives it): trees of
    three siblings drawn from Q, which puts mass on tokens the grammar rules out."""
    bits = torch.tensor(sum(1 << t for t in ALLOWED), dtype=torch.int32)
    gen, draws = torch.Generator().manual_seed(77), device_generator(77)
    counts = torch.zeros(V)
    for _ in range(TRIALS // BATCH):
        trees = [sampled_tree(gen, 3, with_dist=True) for _ in range(BATCH)]
        batch = [
            Candidates(t, ROWS.repeat(len(t) + 1, 1), params, draws, bits.repeat(len(t) + 1, 1))
            for t in trees
        ]
        for verdict in sampler(batch):
            counts[verdict.tokens[0]] += 1
    return counts


def constrained_probs(params: SamplingParams) -> torch.Tensor:
    masked = torch.full_like(P_LOGITS, float("-inf"))
    masked[ALLOWED] = P_LOGITS[ALLOWED]
    return target_probs(masked, params)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
    ids=["t1", "t0.7-topk3"],
)
def test_sampling_under_a_grammar_follows_the_constrained_target(params):
    counts = masked_first_tokens(select, params)
    assert chi_square(counts, constrained_probs(params)) < CHI2_CRITICAL


def test_the_check_catches_a_grammar_applied_after_the_draw():
    """A wrong sampler: it selects without the mask and moves a ruled-out token to the most
    likely allowed one (a common shortcut), which piles mass there."""
    params = SamplingParams(temperature=1.0)
    best = max(ALLOWED, key=lambda t: float(P_LOGITS[t]))

    def after_the_draw(batch: list[Candidates]) -> list[Verdict]:
        unmasked = [Candidates(c.tree, c.logits, c.params, c.generator) for c in batch]
        verdicts = select(unmasked)
        for v in verdicts:
            v.tokens[0] = v.tokens[0] if v.tokens[0] in ALLOWED else best
        return verdicts

    counts = masked_first_tokens(after_the_draw, params)
    assert chi_square(counts, constrained_probs(params)) > 10 * CHI2_CRITICAL


@CPU_KERNELS
def test_greedy_selections_argmax_is_torchs_to_the_index():
    """kernels.argmax (the CPU kernel greedy selection takes) against torch.argmax: the first
    index of the largest value, ties, -inf rows, inf, the first NaN, strided rows, short rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 1003, generator=g)
    x[1, 5], x[1, 900] = float("nan"), float("nan")
    x[2] = float("-inf")
    x[3, 10] = x[3, 20] = 100.0
    x[4] = 1.0
    x[5, 1002] = float("inf")
    for case in (x, torch.randn(9, 2000, generator=g)[:, :1500], torch.randn(3, 5, generator=g)):
        assert kernels.argmax(case).tolist() == case.argmax(-1).tolist()
        finite = torch.isfinite(case).all(-1)
        want = torch.where(finite, case.argmax(-1), -1)  # greedy_rows: -1 where not all finite
        assert kernels.greedy_rows(case).tolist() == want.tolist()


@CPU_KERNELS
def test_samplings_kernels_give_torchs_distribution_and_draw_no_token_of_weight_0():
    """softmax_weights against torch's softmax at each row's own temperature (-inf: weight 0),
    read through a row index; draw against inverse_cdf on weights whose sums are exact (the
    same tokens), and never a token of weight 0, even at u just under 1; and sampling reads
    its rows through them where the logits lie back to back."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 5000, generator=g) * 4
    x[2, :4000] = float("-inf")
    rows, temperature = torch.tensor([4, 2, 0, 2]), torch.tensor([1.0, 0.7, 1.3, 2.0])
    w, sums = kernels.softmax_weights(x, rows, temperature)
    want = torch.softmax(x[rows] / temperature[:, None], -1)
    assert torch.allclose(w / sums[:, None], want, rtol=1e-5, atol=1e-9)
    assert torch.allclose(sums, w.double().sum(1).float(), rtol=1e-6)
    assert (w[1, :4000] == 0).all() and (w[1, 4000:] > 0).all()
    weights = torch.randint(0, 4, (5, 3000), generator=g).float()
    weights[:, 2990:] = 0.0
    weights[4] = 0.0
    weights[4, 17] = 2.0
    for u in (torch.rand(5, generator=g), torch.full((5,), 1 - 2**-24), torch.zeros(5)):
        drawn = kernels.draw(weights, u)
        assert drawn.tolist() == rejection.inverse_cdf(weights, u).tolist()
        assert (weights.gather(1, drawn[:, None]) > 0).all()
    tree = sampled_tree(g, 2, True)
    batch = [
        Candidates(tree, rows, SamplingParams(temperature=1.0))
        for rows in in_one_buffer([tree] * 2)
    ]
    assert rejection.kernel_weights(batch, [(0, 0), (1, 2)]) is not None


@CPU_KERNELS
def test_the_host_walk_gives_the_verdicts_of_the_device_layout():
    """On a CPU, a greedy batch without grammars is selected by walking each tree on the host
    (select_walked); it must give exactly what the layout's tensors give (select_on_device),
    NonFinite included: random trees (siblings repeating a token too), rows with a NaN, an
    inf or a -inf in them."""
    gen = torch.Generator().manual_seed(11)
    vocab, deep, broken = 8, 0, 0
    for _ in range(80):
        batch = []
        for _ in range(int(torch.randint(1, 7, (), generator=gen))):
            tree = random_tree(gen, int(torch.randint(0, 17, (), generator=gen)), vocab, False)
            rows = random_rows(gen, tree, vocab)
            if torch.rand((), generator=gen) < 0.15:
                bad = [float("nan"), float("inf"), float("-inf")][
                    int(torch.randint(3, (), generator=gen))
                ]
                rows[int(torch.randint(len(rows), (), generator=gen)), 3] = bad
            batch.append(Candidates(tree, rows, GREEDY))
        walked, layout = select_walked(batch), select_on_device(batch)
        assert walked is not None
        for w, d in zip(walked, layout, strict=True):
            if isinstance(d, NonFinite):
                assert isinstance(w, NonFinite)
                broken += 1
            else:
                assert (w.accepted, w.tokens) == (d.accepted, d.tokens)
                deep += len(w.accepted) >= 2
    assert deep > 50 and broken > 10
    mixed = [Candidates(DraftTree(), one_hot_rows([1]), SamplingParams(temperature=0.8))]
    assert select_walked(mixed) is None  # sampling sequences take the device's path


def test_a_union_holds_every_path_of_both_trees_within_its_limit():
    from specserve.speculation.tree import union

    chain = DraftTree([5, 6, 7], [-1, 0, 1])
    copy = DraftTree([5, 6, 9, 8, 4], [-1, 0, 1, 0, 3], model_free=True)  # 5 6 9; 5 8 4
    merged = union(chain, copy, limit=5)
    assert merged.token_ids[:3] == [5, 6, 7] and not merged.model_free
    paths = {tuple(merged.path(n)) for n in range(len(merged))}
    assert paths == {(5,), (5, 6), (5, 6, 7), (5, 6, 9), (5, 8)}  # 5 8 4: no room for its 4
    merged.validate(vocab_size=10)
    assert len(union(chain, copy, limit=3)) == 3  # shared nodes merge even without room
    assert union(copy, DraftTree(model_free=True), limit=9).model_free


def test_node_scores_cross_the_wire_and_malformed_ones_are_refused():
    from specserve.speculation.tree import DraftTree, from_proto, to_proto
    from specserve.v1 import drafter_pb2

    tree = DraftTree([4, 5, 6], [-1, 0, 0], model_free=True, scores=[0.9, 0.5, 0.25])
    msg = drafter_pb2.DraftTree()
    to_proto(tree, msg)
    back = from_proto(msg)
    assert back.scores == pytest.approx(tree.scores)  # (float32 on the wire)
    assert back.prefix(2).scores == back.scores[:2] and back.prefix(2).parents == [-1, 0]
    back.validate(10)
    for bad in ([0.9, 0.5], [0.9, 0.5, 1.5], [0.9, float("nan"), 0.1]):
        with pytest.raises(ValueError, match="score"):
            DraftTree([4, 5, 6], [-1, 0, 0], model_free=True, scores=bad).validate(10)
