"""Run-ahead drafting: the next step's tree drafted after the likeliest path, used only when
the step went exactly as assumed."""

from __future__ import annotations

import pytest

from specserve.drafter.run_ahead import RunAhead, likeliest_path, subtree
from specserve.speculation.proposer import DraftJob
from specserve.speculation.suffix import SuffixProposer
from specserve.speculation.tree import DraftTree


def tree_of(edges: list[tuple[int, int]]) -> DraftTree:
    tree = DraftTree()
    for token, parent in edges:
        tree.add(token, parent)
    return tree


def test_the_likeliest_path_follows_first_children_and_subtrees_reroot():
    tree = tree_of([(5, -1), (6, -1), (7, 0), (8, 0), (9, 2), (4, 1)])
    assert likeliest_path(tree) == [5, 7, 9]
    under = subtree(tree, 0, budget=8)
    assert (under.token_ids, under.parents) == ([7, 8, 9], [-1, -1, 0])
    assert subtree(tree, 0, budget=2).token_ids == [7, 8]
    tree.scores = [0.8, 0.1, 0.6, 0.2, 0.4, 0.05]  # (a scored tree: given its top was kept)
    assert subtree(tree, 0, budget=8).scores == pytest.approx([0.75, 0.25, 0.5])


COPIED = list(range(100, 140))
HISTORY = [*COPIED, 7, *COPIED[:10]]  # copying: the suffix tree drafts what follows


def drafted() -> tuple[SuffixProposer, DraftJob, DraftTree]:
    """A proposer, a step's job and the tree it got."""
    proposer = SuffixProposer()
    job = DraftJob("s", list(HISTORY), 8)
    (tree,) = proposer.propose([job])
    return proposer, job, tree


def test_a_run_ahead_tree_is_used_only_when_the_step_went_as_assumed():
    copied, history = COPIED, HISTORY
    proposer, job, tree = drafted()
    path = likeliest_path(tree)
    assert path == copied[10:18]

    ahead = RunAhead()
    ahead.draft(proposer, [(job, tree)])
    bonus = copied[18]  # the target's own token after the accepted path
    went = DraftJob("s", [*history, *path, bonus], 8)
    used = ahead.take(went, accepted_len=len(history))
    assert used is not None and used.token_ids == copied[19:27]
    (fresh,) = SuffixProposer().propose([went])
    assert used.token_ids == fresh.token_ids  # what drafting after the fact gives

    ahead.draft(proposer, [(job, tree)])
    partly = DraftJob("s", [*history, *path[:3], 99], 8)  # rejected inside the path
    assert ahead.take(partly, accepted_len=len(history)) is None
    ahead.draft(proposer, [(job, tree)])
    assert ahead.take(went, accepted_len=len(history) - 1) is None  # history rolled back

    sampled = DraftJob("t", list(history), 8, temperature=0.7)
    ahead.draft(proposer, [(sampled, tree)])
    assert ahead.trees == {}  # sampling requests never run ahead


def test_a_run_ahead_tree_of_a_kind_this_step_wants_none_of_is_not_used():
    proposer, job, tree = drafted()
    ahead = RunAhead()
    ahead.draft(proposer, [(job, tree)])
    went = [*HISTORY, *likeliest_path(tree), COPIED[18]]
    assert ahead.take(DraftJob("s", went, 8, deep_budget=0), accepted_len=len(HISTORY)) is None
