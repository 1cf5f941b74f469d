"""The adaptive speculation policy: cost model fits and the budgets it chooses (pure)."""

from __future__ import annotations

import random

import pytest

from specserve.speculation.policy import (
    EXPLORE_ALPHA,
    PROBE_EVERY,
    SCALE_STEPS,
    AdaptivePolicy,
    Candidate,
    Coefficients,
    CostModel,
    expected_tokens,
)
from specserve.verifier.speculator import EXPLORE_TOKENS, EXPLORE_TREES, explored


def policy_with(a, b, c, d, max_budget=8) -> AdaptivePolicy:
    policy = AdaptivePolicy(max_budget)
    policy.cost.coef = Coefficients(a, b, c, d)
    policy.cost.per_token_known = True
    policy.steps = 1  # away from a probe step
    return policy


def test_expected_tokens_of_a_chain():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 6) == 7


def test_the_cost_model_recovers_measured_coefficients():
    rng = random.Random(0)
    model = CostModel()
    for _ in range(200):
        tokens = rng.randrange(1, 64)
        model.observe_verify(tokens, 0.2 + 0.01 * tokens + rng.gauss(0, 0.002))
        levels, seqs = rng.randrange(1, 8), rng.randrange(1, 8)
        seconds = 0.02 + levels * (0.03 + 0.005 * seqs) + rng.gauss(0, 0.001)
        model.observe_draft(levels, seqs, seconds)
    model.fit()
    coef = model.coef
    assert coef.a == pytest.approx(0.2, abs=0.01) and coef.b == pytest.approx(0.01, abs=0.001)
    assert coef.c == pytest.approx(0.03, abs=0.003) and coef.d == pytest.approx(0.005, abs=0.001)
    assert coef.e == pytest.approx(0.02, abs=0.005)


def test_a_draft_step_that_took_in_a_prompt_does_not_price_the_next_ones():
    """A draft model catching up with a 400-token prompt took 2.5 s where its steps take
    40 ms a level: that step is left out of the fit, and the first steps are fitted at once
    (they price the next), even when a calibrated verify window is long already."""
    model = CostModel()
    model.calibrate({1: 0.058, 2: 0.071, 4: 0.097})
    for _ in range(20):
        model.observe_verify(1, 0.058)
    model.observe_draft(2, 1, 0.08)
    assert model.step_seconds(1, 2, 1) - 0.058 == pytest.approx(0.08, rel=0.05)
    model.observe_draft(3, 1, 2.49)
    model.observe_draft(3, 1, 0.12)
    assert model.step_seconds(1, 3, 1) - 0.058 == pytest.approx(0.12, rel=0.1)


def test_steps_without_drafts_refit_every_so_often_not_every_step(monkeypatch):
    """A verifier whose sequences never ask a draft model adds only verify steps: with the
    verify window long, they refit every REFIT_EVERY steps (each refit is a least-squares
    pass over the window), while the first draft steps still refit at once."""
    from specserve.speculation.policy import REFIT_EVERY

    model = CostModel()
    model.calibrate({1: 0.058, 2: 0.071, 4: 0.097})
    for _ in range(REFIT_EVERY + 1):
        model.observe_verify(1, 0.058)  # (the verify window is long from here on)
    fits = []
    monkeypatch.setattr(model, "fit", lambda: fits.append(1) or CostModel.fit(model))
    for _ in range(4 * REFIT_EVERY):
        model.observe_verify(1, 0.058)
    assert len(fits) == 4
    fits.clear()
    for _ in range(3):
        model.observe_draft(2, 1, 0.08)
    assert len(fits) == 3


def test_coefficients_stay_nonnegative():
    model = CostModel()
    for tokens in range(1, 30):  # time that falls with tokens: noise, not a negative cost
        model.observe_verify(tokens, 0.3 - 0.001 * tokens)
    model.fit()
    assert model.coef.a >= 0 and model.coef.b >= 0


def test_cheap_drafts_of_a_good_draft_get_the_largest_tree():
    policy = policy_with(a=0.2, b=0.005, c=0.01, d=0.0)
    assert policy.budgets([Candidate(8, 0.9)], 0) == [8]


def test_drafts_that_cost_more_than_they_return_are_turned_off():
    policy = policy_with(a=0.2, b=0.005, c=0.15, d=0.0)
    assert policy.budgets([Candidate(8, 0.3)], 0) == [0]


def test_a_large_batch_decodes_plainly_where_a_single_sequence_speculates():
    # Compute-bound verification: every extra token costs as much as a fixed step share.
    policy = policy_with(a=0.05, b=0.01, c=0.005, d=0.001)
    assert policy.budgets([Candidate(8, 0.7)], 0)[0] > 0
    assert policy.budgets([Candidate(8, 0.7)] * 32, 0) == [0] * 32


def test_a_poorly_drafted_sequence_gets_nothing_while_a_well_drafted_one_speculates():
    policy = policy_with(a=0.1, b=0.01, c=0.01, d=0.0)
    good, poor = policy.budgets([Candidate(8, 0.95), Candidate(8, 0.05)], 0)
    assert good > 0 and poor == 0


def test_pinned_sizes_and_caps_are_kept():
    policy = policy_with(a=0.2, b=0.005, c=0.15, d=0.0)
    assert policy.budgets([Candidate(5, 0.1, pinned=True), Candidate(3, 0.99)], 0)[0] == 5
    assert max(policy.budgets([Candidate(2, 0.99)], 0)) <= 2
    assert policy.budgets([Candidate(0, 0.9)], 0) == [0]


def test_a_probe_step_measures_the_drafts_again_where_good_drafts_would_pay():
    """One step in PROBE_EVERY prices the drafts at EXPLORE_ALPHA: a poor rate measured long
    ago is measured again, at the size good drafts would pay at; drafts so slow that even
    good ones cannot pay are not tried."""
    policy = policy_with(a=0.2, b=0.005, c=0.08, d=0.0)
    chosen = [policy.budgets([Candidate(6, 0.3)], 0)[0] for _ in range(PROBE_EVERY)]
    assert chosen.count(0) == PROBE_EVERY - 1 and max(chosen) > 0
    slow = policy_with(a=0.2, b=0.005, c=0.5, d=0.0)
    assert [slow.budgets([Candidate(6, 0.3)], 0)[0] for _ in range(PROBE_EVERY)] == [0] * 64


# The int4 default target on a 2-core AMD EPYC: seconds of a pass by its tokens (the int4
# kernel prices rows in blocks of four).
INT4_PROFILE = {1: 0.058, 2: 0.071, 3: 0.086, 4: 0.097, 5: 0.178, 7: 0.195, 9: 0.26, 17: 0.41}


def test_a_measured_profile_prices_the_kernels_blocks():
    """The profile is interpolated between measured counts and extended by its last slope;
    every step moves its scale (all counts together); the budgets stop at a block's edge."""
    policy = AdaptivePolicy(8)
    policy.cost.calibrate(INT4_PROFILE)
    cost = policy.cost
    assert cost.verify_seconds(4) == pytest.approx(0.097)
    assert cost.verify_seconds(6) == pytest.approx((0.178 + 0.195) / 2)
    assert cost.verify_seconds(21) == pytest.approx(0.41 + 4 * (0.41 - 0.26) / 8)
    policy.steps = 1
    # Cheap drafts of a good draft model: three nodes (four rows), not the fifth row's block.
    assert policy.budgets([Candidate(8, 0.8)], 0) == [3]
    assert policy.deep_budgets([Candidate(64, 0.8)], 1.8 / 0.097, [1]) == [3]
    # Copying (a suffix match the target keeps): deep enough to pay for the next blocks.
    assert policy.deep_budgets([Candidate(64, 0.99)], 1.8 / 0.097, [1])[0] >= 16
    # Poor drafts: plain decoding.
    assert policy.budgets([Candidate(8, 0.2)], 0) == [0]
    for _ in range(30):
        cost.observe_verify(1, 0.116)  # (other processes on the cores: plain steps take 2x)
    assert cost.verify_seconds(4) == pytest.approx(0.194, rel=0.01)  # every count 2x
    assert policy.budgets([Candidate(8, 0.8)], 0) == [3]  # the same shape: the same budget


def test_one_stalled_step_leaves_the_price_of_a_pass_alone():
    """The profile's scale is the median of the last steps: a step that other work stalled
    (7x its profile, as a request ended beside it) moves no price, so the next steps do not
    find the draft model cheap beside passes that look 2.3x dearer; a slowdown that lasts
    moves every price within SCALE_STEPS steps."""
    policy = AdaptivePolicy(8)
    policy.cost.calibrate(INT4_PROFILE)
    cost = policy.cost
    for _ in range(20):
        cost.observe_verify(1, 0.058)
    cost.observe_verify(1, 7 * 0.058)
    assert cost.verify_seconds(4) == pytest.approx(0.097)
    cost.observe_verify(4, 0.097)
    for _ in range(SCALE_STEPS // 2 + 1):
        cost.observe_verify(1, 2 * 0.058)
    assert cost.verify_seconds(4) == pytest.approx(2 * 0.097)


def test_acceptance_estimates_move_from_the_prior_to_what_is_measured():
    policy = AdaptivePolicy(8)
    assert policy.alpha(0, 0) == pytest.approx(policy.service_alpha)
    assert policy.alpha(95, 100) > 0.9
    assert policy.alpha(5, 100) < 0.1
    for _ in range(500):
        policy.observe_acceptance(1, 10)
    assert policy.service_alpha == pytest.approx(0.1, abs=0.01)


def test_model_free_trees_go_as_deep_as_their_acceptance_pays_for():
    """Deep budgets: the last node must be expected to add more than the step's rate loses
    in its verify time (alpha^k >= b x rate); pinned sizes and the cap still rule."""
    policy = policy_with(0.25, 0.002, 0.05, 0.0, max_budget=6)
    rate = 8.0  # tokens/s: each node costs 0.016 tokens of the step's rate
    copying, prose = policy.deep_budgets([Candidate(64, 0.97), Candidate(64, 0.6)], rate)
    assert copying == 64 and 0 < prose < 10  # 0.97^64 = 0.14; 0.6^k passes 0.016 at k = 8
    assert policy.deep_budgets([Candidate(20, 0.97)], rate) == [20]  # the cap
    assert policy.deep_budgets([Candidate(32, 0.1, pinned=True)], rate) == [32]
    loaded = policy.deep_budgets([Candidate(64, 0.97)], 300.0)  # a big batch: nodes cost more
    assert loaded[0] < 64


def test_acceptance_of_model_free_trees_is_kept_apart():
    policy = AdaptivePolicy(8)
    for _ in range(200):
        policy.observe_acceptance(9, 10, free=True)
        policy.observe_acceptance(1, 10)
    assert policy.alpha(0, 0, free=True) > 0.85 and policy.alpha(0, 0) < 0.15


def test_steps_of_one_size_leave_the_token_cost_unknown_and_drafts_get_tried():
    """Only plain steps seen (a warm-up): a per-token cost cannot be told from the step's,
    so it is taken as 0 (not half the step), and the policy drafts, which measures it."""
    policy = AdaptivePolicy(6)
    for _ in range(20):
        policy.cost.observe_verify(1, 0.45)
    assert policy.cost.coef.a == pytest.approx(0.45) and policy.cost.coef.b == 0.0
    policy.steps = 1
    assert policy.budgets([Candidate(6, 0.6)], 0) == [6]
    # ... but not deep: 64 nodes of unknown cost could take many times a step
    assert policy.deep_budgets([Candidate(64, 0.6)], 2.0) == [6]


def test_the_acceptance_replay_accepts_what_a_tree_path_follows():
    """benchmarks/acceptance.py's rule: the longest path of the tree that the target's output
    follows, from the root; and Hugging Face's prompt lookup rule as written there."""
    from benchmarks.acceptance import PromptLookup, accepted
    from specserve.speculation.proposer import DraftJob
    from specserve.speculation.tree import DraftTree

    tree = DraftTree()
    a = tree.add(5, -1)
    tree.add(6, a)
    b = tree.add(7, -1)
    c = tree.add(8, b)
    tree.add(9, c)
    assert accepted(tree, [7, 8, 9, 1]) == 3
    assert accepted(tree, [5, 6, 9]) == 2
    assert accepted(tree, [6]) == 0
    assert accepted(tree, []) == 0
    history = [1, 2, 3, 4, 9, 9, 2, 3]  # the last two tokens occurred at 1..2: then 4, 9, 9, ...
    (chain,) = PromptLookup(depth=3).propose([DraftJob("s", history, 3)])
    assert chain.token_ids == [4, 9, 9] and chain.parents == [-1, 0, 1]
    (none,) = PromptLookup().propose([DraftJob("s", [1, 2, 3], 3)])
    assert len(none) == 0


def test_a_model_free_tree_that_rarely_matches_is_not_asked_for():
    """Expected tokens scale with the share of asks that found a match, and the drafter's
    round trip counts where only the model-free tree would ask it; a probe asks anyway."""
    policy = AdaptivePolicy(8)
    policy.cost.calibrate(INT4_PROFILE)
    policy.steps = 1
    rate = 1 / 0.058
    assert policy.deep_budgets([Candidate(64, 0.6, hit=1.0)], rate, [1], [0.002])[0] > 0
    assert policy.deep_budgets([Candidate(64, 0.6, hit=0.1)], rate, [1], [0.002]) == [0]
    assert policy.deep_budgets([Candidate(64, 0.6, hit=1.0)], rate, [1], [0.05]) == [0]
    policy.steps = PROBE_EVERY
    assert policy.deep_budgets([Candidate(64, 0.6, hit=0.1)], rate, [1], [0.002])[0] > 0


def test_a_model_free_trees_depth_does_not_shrink_with_its_misses():
    """An ask that finds no match verifies no node: how often asks match decides whether to
    ask, not how deep a match may go (charging every ask the nodes' time cut it short)."""
    policy = AdaptivePolicy(8)
    policy.cost.calibrate(INT4_PROFILE)
    policy.steps = 1
    rate = 1 / 0.058
    (always,) = policy.deep_budgets([Candidate(64, 0.9, hit=1.0)], rate, [1], [0.002])
    (half,) = policy.deep_budgets([Candidate(64, 0.9, hit=0.5)], rate, [1], [0.002])
    assert always >= 4 and half == always


def test_a_draft_models_catch_up_is_spread_over_what_the_sequence_has_left():
    """Before its first draft-model tree a sequence's context goes through the draft model
    (2.5 s for 400 tokens here): worth it for a long answer, not for a short one after a long
    prompt. Priced from the profile until a catch-up is measured."""
    policy = AdaptivePolicy(8)
    cost = policy.cost
    cost.calibrate(INT4_PROFILE)
    cost.coef.c = 0.02  # seconds a draft level
    policy.steps = 1
    assert cost.catch_up_seconds(17) == pytest.approx(INT4_PROFILE[17] / 3)
    cost.observe_catch_up(400, 2.5)
    behind = cost.catch_up_seconds(150)
    assert behind == pytest.approx(150 * 2.5 / 400)
    assert policy.budgets([Candidate(8, 0.8)], 0)[0] > 0  # (caught up)
    assert policy.budgets([Candidate(8, 0.8, catch_up=behind, remaining=96)], 0) == [0]
    assert policy.budgets([Candidate(8, 0.8, catch_up=behind, remaining=4000)], 0)[0] > 0
    # Of two sequences, the one whose draft model has its context drafts alone (cheap
    # drafts and a linear verify cost: both would draft if both were caught up).
    linear = policy_with(0.05, 0.004, 0.002, 0.0)
    assert all(linear.budgets([Candidate(8, 0.8), Candidate(8, 0.8)], 0))
    pair = [Candidate(8, 0.8, catch_up=behind, remaining=96), Candidate(8, 0.8)]
    ks = linear.budgets(pair, 0)
    assert ks[0] == 0 and ks[1] > 0
    cost.observe_catch_up(100, 0.1)  # (a later one, cheaper: the average moves)
    assert cost.catch_up_seconds(150) < behind


# The default target's verify profile on a 2-core AVX2-only EPYC (Zen 3), as its verifier timed it.
AVX2_PROFILE = {1: 0.0334, 2: 0.0391, 3: 0.0468, 4: 0.0572, 5: 0.0782, 9: 0.1373, 17: 0.2395}


def test_a_drafters_own_timing_prices_its_draft_model_until_draft_steps_are_timed():
    """On that EPYC the draft model's drafter timed 16 ms a level and 5 ms a token of context,
    against 33 ms for the target's one-token pass: no tree of it pays for taking in a 39-token
    prompt at one stream. Priced at nothing until a draft step was timed, a fresh verifier's
    first drafting request tried it anyway (six asks, 419 ms of a 23-token answer: 0.74x its
    plain). Its drafter's timing prices it from the start; steps timed here replace it."""
    policy = AdaptivePolicy(8)
    cost = policy.cost
    cost.calibrate(AVX2_PROFILE)
    policy.steps = 1  # away from a probe step

    def budget() -> int:
        (k,) = policy.budgets(
            [Candidate(8, EXPLORE_ALPHA, catch_up=cost.catch_up_seconds(39), remaining=16)], 0
        )
        return k

    assert budget() > 0  # (unpriced: tried)
    cost.draft_prior(0.016, 0.005)
    assert cost.catch_up_seconds(39) == pytest.approx(39 * 0.005)
    assert cost.draft_seconds(2, 1) == pytest.approx(0.032)
    assert budget() == 0
    cost.observe_draft(2, 1, 0.008)  # a cheaper draft model than its drafter timed
    assert cost.draft_seconds(2, 1) == pytest.approx(0.008, rel=0.05)
    cost.draft_prior(0.016, 0.005)  # (a stream opened again: the timed steps stay)
    assert cost.draft_seconds(2, 1) == pytest.approx(0.008, rel=0.05)


def test_a_prompt_chunk_in_the_step_does_not_make_drafts_look_cheap():
    """A step that carries a 512-token prompt chunk takes seconds whatever is drafted: drafts
    are judged against plain decoding's rate without it, so poor ones stay off there too."""
    policy = AdaptivePolicy(8)
    policy.cost.calibrate(INT4_PROFILE)
    policy.cost.coef.c = 0.02
    policy.steps = 1
    poor = [Candidate(8, 0.3) for _ in range(4)]
    assert policy.budgets(poor, 0) == [0, 0, 0, 0]
    assert policy.budgets(poor, 512) == [0, 0, 0, 0]
    assert policy.budgets([Candidate(8, 0.8)], 512) == policy.budgets([Candidate(8, 0.8)], 0)


def test_exploring_model_free_trees_ends_after_a_few_however_few_tokens_they_tested():
    """A suffix match the target rejects at its first token tests one token: priced at
    EXPLORE_ALPHA until EXPLORE_TOKENS were tested, a rarely matching tree on prose was asked
    for every step of a whole answer. After EXPLORE_TREES trees the sequence is priced at
    what it measured, and such a tree is no longer asked for."""
    policy = AdaptivePolicy(8)
    policy.cost.calibrate(INT4_PROFILE)
    policy.steps = 1
    rate = 1 / 0.058

    def deep_budget(trees: int) -> int:  # each tree rejected at its first token
        alpha = explored(policy.alpha(0, trees, free=True), trees, trees)
        return policy.deep_budgets([Candidate(64, alpha, hit=0.2)], rate, [1], [0.002])[0]

    assert EXPLORE_TREES < EXPLORE_TOKENS
    assert deep_budget(EXPLORE_TREES - 1) > 0
    assert deep_budget(EXPLORE_TREES) == 0
    # a draft model's trees (no count of trees given) explore until EXPLORE_TOKENS, as before
    assert explored(0.1, EXPLORE_TOKENS - 1) == EXPLORE_ALPHA


def test_node_scores_are_calibrated_by_what_the_target_kept_of_such_nodes():
    """Histogram binning: a score's chance is its bin's prior (what the target kept of such
    nodes on the public workloads, below the score) until nodes of its bin are checked; then
    the bin reads what the target kept of them, each bin apart, the oldest fading."""
    from specserve.speculation.policy import SCORE_PRIOR, SCORE_WINDOW_NODES, ScoreCalibration

    calibration = ScoreCalibration()
    assert calibration.chances([0.93, 0.31]) == pytest.approx([SCORE_PRIOR[9], SCORE_PRIOR[3]])
    assert all(p < (b + 1) / len(SCORE_PRIOR) for b, p in enumerate(SCORE_PRIOR))
    for _ in range(100):
        calibration.observe([0.93, 0.91, 0.31], [True, False, True])
    high, low = calibration.chances([0.92, 0.35])
    assert high == pytest.approx(0.5, abs=0.03) and low == pytest.approx(1.0, abs=0.07)
    for _ in range(int(SCORE_WINDOW_NODES)):
        calibration.observe([0.95], [False])
    assert calibration.checked.max() <= SCORE_WINDOW_NODES
    assert calibration.chances([0.95])[0] < 0.05


def test_a_scored_tree_keeps_the_nodes_that_pay_and_all_while_a_token_is_unpriced():
    policy = AdaptivePolicy(8)
    scores = [0.95, 0.95, 0.45, 0.15, 0.15]
    assert policy.scored_nodes(scores, 1, 10.0) == 5  # (nothing measured: all are checked)
    policy.cost.calibrate({n: 0.05 + 0.01 * n for n in (1, 2, 4, 8, 16)})
    rate = 1 / 0.06  # a plain step's: a node costs 1/6 of a token
    assert policy.scored_nodes(scores, 1, rate) == 3
    assert policy.scored_nodes([0.15, 0.95], 1, rate) == 2  # (a likely child pays for it)
    assert policy.scored_nodes([0.15], 1, rate) == 0


def test_a_sequences_record_refines_the_chances_of_its_bins_and_fades():
    """SequenceScores: the service-wide chances at first; nodes of a bin that the target
    rejected bring that bin's chance down for the sequence alone, and leave other bins as
    they were (a miss on a short match does not price a long one); older trees fade, so a
    run of kept nodes lifts the bin again. A lowered bin keeps fewer nodes of the same tree."""
    from specserve.speculation.policy import SequenceScores

    policy = AdaptivePolicy(8)
    policy.cost.calibrate({n: 0.05 + 0.01 * n for n in (1, 2, 4, 8, 16)})
    record = SequenceScores()
    scores = [0.95, 0.75, 0.45, 0.35]
    service = policy.scores.chances(scores)
    assert list(policy.scores.chances(scores, record)) == pytest.approx(list(service))
    record.observe([0.75, 0.45, 0.35], [False, False, False])
    refined = policy.scores.chances(scores, record)
    assert refined[0] == pytest.approx(service[0])  # (no node of its bin checked)
    assert all(refined[1:] < 0.7 * service[1:])
    for _ in range(60):
        record.observe([0.45], [True])
    assert policy.scores.chances([0.45], record)[0] > 0.9  # (the prior weighs 2 of ~22 nodes)
    rate = 1 / 0.06
    assert policy.scored_nodes(scores, 1, rate) == 4
    low = SequenceScores()
    for _ in range(10):
        low.observe([0.75, 0.45, 0.35], [False, False, False])
    assert policy.scored_nodes(scores, 1, rate, low) == 1


def test_a_noisy_profile_is_read_as_the_closest_one_that_never_falls():
    policy = AdaptivePolicy(8)
    policy.cost.calibrate({1: 0.060, 5: 0.112, 6: 0.164, 7: 0.131, 8: 0.165, 9: 0.185})
    cost = policy.cost
    assert cost.verify_seconds(6) == cost.verify_seconds(7) == pytest.approx((0.164 + 0.131) / 2)
    assert cost.verify_seconds(5) == pytest.approx(0.112) and cost.verify_seconds(9) == 0.185
    times = [cost.verify_seconds(n) for n in range(1, 12)]
    assert times == sorted(times)
