"""The speculator's budgets: draft-model and model-free trees, priced and adaptive."""

from __future__ import annotations

import copy

from specserve.common.settings import VerifierSettings


def test_budgets_pair_draft_model_and_model_free_caps_and_stay_adaptive_without_deep():
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.verifier.speculator import Speculator

    def budgets(measured=True, node_seconds=0.2, **settings):
        loaded = VerifierSettings.load(
            None, speculative_decoding=True, discover_drafters=False, **settings
        )
        speculator = Speculator(loaded.speculation, loaded.batch, vocab_size=1000)
        seqs = []
        for _ in range(3):
            seq = make_sequence([5, 6, 7], output=[8], max_tokens=200)
            seq.kv = SimpleNamespace(length=3)
            if measured:  # poor acceptance, measured over many drafts of either kind
                seq.drawn_tested = seq.free_tested = 100
                seq.drawn_accepted = seq.free_accepted = 30
            seqs.append(seq)
        policy = speculator.policy
        if policy is not None:  # (0.2 s: a big batch whose nodes cost more than they return)
            policy.steps = 1
            policy.cost.coef.a, policy.cost.coef.b = 0.1, node_seconds
            policy.cost.per_token_known = True
            policy.service_alpha = policy.service_free_alpha = 0.3
        asked = speculator.budgets(seqs)
        if speculator._step is None:
            return asked
        # A sequence whose draft model has no budget asks for a model-free tree of its cap
        # (scored ones are cut to what pays on arrival); an unscored one is cut to the deep
        # budget priced by its acceptance, which these tests read.
        assert all(deep == 64 for k, deep in asked if k == 0) or settings["deep_tree_size"] == 0
        return [
            (k, priced if k == 0 else deep)
            for (k, deep), priced in zip(asked, speculator._step.deep, strict=True)
        ]

    fixed = dict(speculation_policy="fixed", verification_tree_size=6, deep_tree_size=40)
    assert budgets(**fixed) == [(6, 40)] * 3
    adaptive = dict(speculation_policy="adaptive", verification_tree_size=6)
    assert budgets(**adaptive, deep_tree_size=0) == [(0, 0)] * 3  # the policy still decides
    assert budgets(**adaptive, deep_tree_size=64) == [(0, 0)] * 3
    # Not measured yet: priced as good drafts (EXPLORE_ALPHA) rather than by the service-wide
    # rate alone, they draft to find out where good drafts would pay, at the size they would
    # pay at; where nodes cost more than even good drafts return, they do not.
    assert budgets(False, **adaptive, deep_tree_size=64) == [(0, 0)] * 3
    cheap = budgets(False, 0.002, **adaptive, deep_tree_size=64)
    assert all(0 < k <= 6 and 0 < deep <= 64 for k, deep in cheap)
    assert budgets(False, 0.002, **adaptive, deep_tree_size=0) == [(k, 0) for k, _ in cheap]
    assert budgets(True, 0.002, **adaptive, deep_tree_size=64) != cheap  # (measured: poor)


def test_an_unscored_model_free_tree_explores_shallow_and_goes_deep_once_measured():
    """While a sequence's model-free trees are measured (EXPLORE_TREES of them), an unscored
    one (an n-gram match) is cut to at most EXPLORE_DEPTH nodes: a rejection ends a tree at
    any depth, so a deep one tested no better and cost a 7-node pass each time; measured
    good, they go as deep as they pay."""
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.speculation.tree import DraftTree
    from specserve.verifier.speculator import EXPLORE_DEPTH, EXPLORE_TREES, Speculator

    settings = VerifierSettings.load(
        None, speculative_decoding=True, discover_drafters=False, deep_tree_size=64
    )
    speculator = Speculator(settings.speculation, settings.batch, vocab_size=1000)
    policy = speculator.policy
    policy.steps = 1
    policy.cost.coef.a, policy.cost.coef.b = 0.05, 0.002
    policy.cost.per_token_known = True
    seq = make_sequence([5, 6, 7], output=[8], max_tokens=500)
    seq.kv = SimpleNamespace(length=3)
    seq.drawn_tested, seq.drawn_accepted = 100, 0  # (no draft-model trees: they never pass)
    ngram = DraftTree(list(range(10, 50)), list(range(-1, 39)), model_free=True)

    def kept() -> int:
        budgets = speculator.budgets([seq])
        assert budgets == [(0, 64)]  # (asked for its cap: the cut comes on arrival)
        (tree,) = speculator._priced([seq], [ngram], budgets)
        return len(tree)

    exploring_deep = kept()
    seq.free_trees, seq.free_tested, seq.free_accepted = EXPLORE_TREES, 30, 29
    measured_deep = kept()
    assert 0 < exploring_deep <= EXPLORE_DEPTH < measured_deep


def test_a_draft_model_that_fell_behind_has_its_catch_up_priced():
    """Its draft model last grew the sequence a tree 150 tokens ago (plain steps since): on a
    probe step, which prices its drafts at EXPLORE_ALPHA, taking those tokens in first costs
    more than the exploring horizon can win back, so the draft model stays off; one step
    behind, the same probe drafts."""
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.speculation.policy import PROBE_EVERY
    from specserve.verifier.speculator import Speculator

    settings = VerifierSettings.load(
        None, speculative_decoding=True, discover_drafters=False, deep_tree_size=0
    )
    speculator = Speculator(settings.speculation, settings.batch, vocab_size=1000)
    policy = speculator.policy
    policy.cost.coef.a, policy.cost.coef.b, policy.cost.coef.c = 0.05, 0.002, 0.01
    policy.cost.per_token_known = True
    policy.cost.observe_catch_up(100, 1.0)  # 10 ms a token
    seq = make_sequence(list(range(200)), output=[8], max_tokens=500)
    seq.kv = SimpleNamespace(length=200)
    seq.drawn_tested, seq.drawn_accepted = 100, 10  # measured poor: only a probe drafts

    def probe(behind: int) -> int:
        seq.drawn_at = len(seq.all_ids) - behind
        policy.steps = PROBE_EVERY - 1  # (the next budgets call is a probe step)
        ((k, _),) = speculator.budgets([seq])
        return k

    assert probe(1) > 0
    assert probe(150) == 0
    policy.steps = 1
    assert speculator.budgets([seq]) == [(0, 0)]  # (and off a probe, poor drafts do not pay)


def test_a_pinned_tree_size_stays_within_the_operators_largest_tree():
    """A request may pin speculation.tree_size (up to 256 at the gateway); the verifier grows
    no tree past the larger of verification_tree_size and deep_tree_size for it, so one
    client cannot slow its batch-mates' steps with trees the operator never allowed."""
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.verifier.speculator import Speculator

    settings = VerifierSettings.load(
        None,
        speculative_decoding=True,
        discover_drafters=False,
        verification_tree_size=6,
        deep_tree_size=40,
    )
    speculator = Speculator(settings.speculation, settings.batch, vocab_size=1000)
    seq = make_sequence([5, 6, 7], output=[8], max_tokens=500)
    seq.kv = SimpleNamespace(length=3)
    for pinned, cap in ((256, 40), (20, 20), (3, 3)):
        seq.tree_size = pinned
        assert speculator.cap(seq) == speculator.cap(seq, settings.deep_tree_size) == cap


def test_a_model_free_tree_with_draft_distributions_is_dropped():
    from specserve.speculation.tree import DraftTree, to_proto
    from specserve.v1 import drafter_pb2
    from specserve.verifier.speculator import Speculator

    settings = VerifierSettings.load(None)
    speculator = Speculator(settings.speculation, settings.batch, vocab_size=1000)
    tree = DraftTree(token_ids=[1, 2], parents=[-1, 0], model_free=True)
    msg = drafter_pb2.DraftTree()
    to_proto(tree, msg)
    assert len(speculator._checked(msg, (0, 2))) == 2  # a model-free tree: the deep budget
    assert len(speculator._checked(msg, (2, 1))) == 0  # over it
    tree.dists[-1] = ([1], [1.0])
    msg = drafter_pb2.DraftTree()
    to_proto(tree, msg)
    assert len(speculator._checked(msg, (8, 8))) == 0


def test_a_draft_model_tree_may_hold_a_model_free_trees_nodes_within_the_larger_budget():
    """The hybrid's union of a chain and a suffix tree: a draft model's tree up to the larger
    of the sequence's two budgets, and none where the draft model had no budget."""
    from specserve.speculation.tree import DraftTree, to_proto
    from specserve.v1 import drafter_pb2
    from specserve.verifier.speculator import Speculator

    settings = VerifierSettings.load(None)
    speculator = Speculator(settings.speculation, settings.batch, vocab_size=1000)
    msg = drafter_pb2.DraftTree()
    to_proto(DraftTree(token_ids=[1, 2, 3, 4], parents=[-1, 0, -1, 2]), msg)
    assert len(speculator._checked(msg, (2, 4))) == 4
    assert len(speculator._checked(msg, (2, 3))) == 0  # over both
    assert len(speculator._checked(msg, (0, 8))) == 0  # the draft model was not to run


def _adaptive(**settings):
    """A speculator whose verify pass costs 50 ms plus 10 ms a token (a node costs 0.2 of a
    plain step), and one sequence of it, not drafting with a draft model."""
    from types import SimpleNamespace

    from helpers import make_sequence
    from specserve.verifier.speculator import Speculator

    loaded = VerifierSettings.load(
        None, speculative_decoding=True, discover_drafters=False, deep_tree_size=64, **settings
    )
    speculator = Speculator(loaded.speculation, loaded.batch, vocab_size=1000)
    speculator.policy.cost.calibrate({n: 0.04 + 0.01 * n for n in (1, 2, 4, 8, 16, 32, 65)})
    seq = make_sequence([5, 6, 7], output=[8], max_tokens=500)
    seq.kv = SimpleNamespace(length=3)
    seq.drawn_tested, seq.drawn_accepted = 100, 0  # (its draft model never pays)
    return speculator, seq


def test_a_scored_model_free_tree_is_cut_to_the_nodes_whose_calibrated_chances_pay():
    """A suffix tree's nodes come with the drafter's chance that the target keeps each one's
    path. The verifier checks the first nodes whose chances, calibrated by what the target
    kept of such nodes before, pay for the time they add (here 0.2 of a step a node): a long
    copy's likely nodes, not its unlikely tail; once nodes of that score have been kept a
    tenth of the time, none."""
    from specserve.speculation.tree import DraftTree

    speculator, seq = _adaptive()
    scores = [0.95, 0.93, 0.91, 0.89, 0.05, 0.04, 0.03]
    tree = DraftTree(list(range(10, 17)), list(range(-1, 6)), model_free=True, scores=scores)
    budgets = speculator.budgets([seq])
    assert budgets == [(0, 64)]
    (kept,) = speculator._priced([seq], [tree], budgets)
    assert kept.token_ids == [10, 11, 12, 13] and kept.scores == scores[:4]
    for _ in range(50):  # the target keeps a tenth of such paths
        speculator.observe_acceptance(seq, tree, [0] if _ % 10 == 0 else [], 1)
    (kept,) = speculator._priced([seq], [tree], speculator.budgets([seq]))
    assert len(kept) == 0
    seq.tree_size = 7  # a request that pinned its tree size keeps it whole
    (kept,) = speculator._priced([seq], [tree], speculator.budgets([seq]))
    assert len(kept) == 7


def test_a_sequence_whose_scored_trees_come_true_less_than_the_bins_say_checks_fewer_nodes():
    """The score bins are service-wide; each sequence's own record refines them: two streams
    get the same trees, the target keeps each path of one and nothing of the other, so the
    bins read half, and the first checks more of a new tree than the second does (none)."""
    from specserve.speculation.tree import DraftTree

    speculator, copying = _adaptive()
    _, prose = _adaptive()
    scores = [0.75, 0.72, 0.7, 0.68, 0.65, 0.62]
    tree = DraftTree(list(range(10, 16)), list(range(-1, 5)), model_free=True, scores=scores)
    for _ in range(30):
        speculator.observe_acceptance(copying, tree, list(range(len(tree))), len(tree))
        speculator.observe_acceptance(prose, tree, [], 1)
    chances = speculator.policy.scores.chances
    assert all(chances(scores, copying.scored) > 0.9) and all(chances(scores, prose.scored) < 0.1)
    budgets = speculator.budgets([copying])
    (for_copying,) = speculator._priced([copying], [tree], budgets)
    (for_prose,) = speculator._priced([prose], [tree], budgets)
    assert len(for_copying) == len(tree) and len(for_prose) == 0


def test_a_miss_on_a_short_match_does_not_cut_a_later_long_one():
    """An edit's first suffix trees (short matches on lines it rewrites: middling scores)
    are rejected whole; a later tree of a long copy (scores of 0.9 and more) is still
    checked, where one factor over all bins had cut it, and every one after it, to nothing."""
    from specserve.speculation.tree import DraftTree

    speculator, seq = _adaptive()
    short = DraftTree([5, 6, 7, 8], [-1, 0, 1, 2], model_free=True, scores=[0.75, 0.6, 0.5, 0.43])
    for _ in range(2):
        speculator.observe_acceptance(seq, short, [], 1)
    scores = [0.97, 0.94, 0.91, 0.89, 0.86, 0.84]
    copy = DraftTree(list(range(10, 16)), list(range(-1, 5)), model_free=True, scores=scores)
    (kept,) = speculator._priced([seq], [copy], speculator.budgets([seq]))
    assert len(kept) == len(copy)


def test_trees_cut_to_nothing_are_scored_against_the_tokens_that_follow():
    """A model-free tree the policy does not check is kept as the sequence's shadow and
    scored against the tokens the sequence emits next (a node is kept when the target's
    token at its place is its own): nodes whose bins were priced too low, so that no tree
    of them was checked, come to be checked without one of them paying its way in."""
    from specserve.speculation.tree import DraftTree

    speculator, seq = _adaptive()
    scores = [0.95, 0.93, 0.91, 0.89, 0.87, 0.85]
    chain = list(range(-1, len(scores) - 1))
    rejected = DraftTree(list(range(10, 16)), chain, model_free=True, scores=scores)
    for _ in range(20):  # the bins learn that such paths are never kept
        speculator.observe_acceptance(seq, rejected, [], 1)
    answer = [100 + i for i in range(400)]  # what the target emits, one token a step

    def copy(seqs, budgets):  # the drafter: a copy of the answer's next tokens
        at = len(seq.output_ids)
        return [DraftTree(answer[at : at + len(scores)], chain, model_free=True, scores=scores)]

    speculator._ask_drafters = copy
    seq.output_ids = answer[:1]
    tested, shadowed, checked_at = seq.tested, 0, None
    for step in range(200):
        (tree,) = speculator.propose([seq])
        shadowed += seq.shadow is not None and seq.shadow.start == len(seq.output_ids)
        if len(tree):
            checked_at = step
            break
        seq.output_ids.append(answer[len(seq.output_ids)])
    assert seq.tested == tested  # nothing was checked on the way
    assert shadowed >= 2 and checked_at is not None
    assert seq.free_trees >= 1 and seq.free_accepted >= len(scores)
    # A shadow the sequence ends before its nodes are decided teaches nothing.
    seq.shadow = None
    unlikely = DraftTree([1, 2], [-1, 0], model_free=True, scores=[0.1, 0.1])
    speculator._ask_drafters = lambda seqs, budgets: [unlikely]
    speculator.propose([seq])
    assert seq.shadow is not None and seq.shadow.checked == 0
    before = speculator.policy.scores.checked.copy()
    seq.output_ids.append(1)
    seq.finish_reason = "FINISH_REASON_STOP"
    speculator.forget(seq)
    assert seq.shadow is None and (speculator.policy.scores.checked == before).all()


def test_asks_that_keep_nothing_back_off_together_and_one_that_keeps_a_tree_resets():
    """Each ask for a model-free tree alone is a round trip to the drafter: after asks in a
    row that kept nothing (no match, or nothing that paid) a sequence waits at least 1, 3, 7,
    then FREE_WAIT_MAX steps, and asks on the next step that is a multiple of that wait plus
    one, so that sequences which wait, however their asks started, ask in the same steps (one
    round trip); an ask that keeps a tree ends the wait."""
    from specserve.speculation.tree import DraftTree
    from specserve.verifier.speculator import FREE_WAIT_MAX

    speculator, seq = _adaptive()
    late = copy.deepcopy(seq)  # (a second stream, joining 5 steps later)
    asked_at: dict[int, list[int]] = {id(seq): [], id(late): []}
    for step in range(100):
        running = [seq] if step < 5 else [seq, late]
        for s, (_, deep) in zip(running, speculator.budgets(running), strict=True):
            if deep:
                asked_at[id(s)].append(speculator.steps)
                speculator._asked_alone(s, DraftTree())
    first, second = asked_at[id(seq)], asked_at[id(late)]
    waits = [1, 3, 7, FREE_WAIT_MAX, FREE_WAIT_MAX]
    assert len(first) > len(waits) and len(second) > len(waits)
    for asks in (first, second):
        gaps = [b - a - 1 for a, b in zip(asks, asks[1:], strict=False)]
        assert all(gap >= wait for gap, wait in zip(gaps, waits, strict=False))
        assert all(step % (wait + 1) == 0 for step, wait in zip(asks[1:], waits, strict=False))
    assert first[0] == 1 and second[0] == 6  # (each asked at once)
    assert first[-3:] == second[-3:]  # waiting the longest, they ask together
    speculator._asked_alone(seq, DraftTree([3], [-1], model_free=True))
    assert seq.free_next <= speculator.steps + 1 and speculator.budgets([seq]) == [(0, 64)]


def test_counts_timed_slower_than_larger_ones_are_timed_again():
    """The verify profile at start: a count timed far above a larger count's time (other work
    on the cores, as the other services start) is timed again, up to twice, and the least
    kept; counts timed as they should be are timed once (twice for small ones). The largest
    count has nothing to be checked against: its neighbours' reading, non-decreasing, takes
    care of it."""
    from specserve.verifier.speculator import CALIBRATE_COUNTS, Speculator

    loaded = VerifierSettings.load(None, speculative_decoding=True, discover_drafters=False)
    speculator = Speculator(loaded.speculation, loaded.batch, vocab_size=1000)
    slowed = {1: 3, 2: 2, 25: 1, 65: 1}  # count: how many of its passes (after the warm-up)
    calls = []  # are slowed 10x

    def time_pass(tokens: int) -> float:
        calls.append(tokens)
        seconds = 0.04 + 0.01 * tokens
        if len(calls) > 1 and slowed.get(tokens, 0) > 0:
            slowed[tokens] -= 1
            seconds *= 10
        return seconds

    measured = speculator.calibrate(time_pass, 65)
    expected = {n: 0.04 + 0.01 * n for n in CALIBRATE_COUNTS}
    assert measured == expected | {65: 10 * expected[65]}
    assert speculator.policy.cost.profile == measured
    assert [calls.count(n) for n in (1, 2, 3, 25, 33, 65)] == [1 + 2 + 2, 2 + 1, 2, 1 + 1, 1, 1]
