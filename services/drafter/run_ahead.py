"""Run-ahead drafting (`run_ahead` in the drafter's settings): once a step's trees are sent,
and while the verifier verifies them, the drafter drafts the next step as if each tree's
likeliest path were accepted whole. The target then adds one token of its own after that
path; if the next message shows exactly the path and a token that is one of the run-ahead
tree's first-level nodes, the subtree under that node is the next step's tree, ready at
once. Anything else throws the run-ahead tree away and the step is drafted as usual.

Greedy sequences only: a sampling request's next draws come with its next message, and its
trees must not depend on anything else. Whether a tree is used depends only on the tokens the
target emitted, never on timing: the next message waits for the run-ahead draft to finish.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..speculation.proposer import DraftJob, Proposer
from ..speculation.tree import DraftTree, node_limit
from . import metrics


def likeliest_path(tree: DraftTree) -> list[int]:
    """Tokens of the path that follows each node's first child: proposers list children
    likeliest first (top-k order, best-first growth)."""
    kids, node, path = tree.children(), -1, []
    while kids.get(node):
        node = kids[node][0]
        path.append(tree.token_ids[node])
    return path


def subtree(tree: DraftTree, top: int, budget: int) -> DraftTree:
    """The nodes under `top`, re-rooted (top's children become the root's), in the order they
    were listed, at most `budget` of them; a scored tree's scores given that top was kept."""
    out = DraftTree(model_free=tree.model_free)
    index = {top: -1}
    for i, parent in enumerate(tree.parents):
        if len(out) >= budget:
            break
        if parent in index:
            index[i] = out.add(tree.token_ids[i], index[parent])
            if tree.scores:
                out.scores.append(min(1.0, tree.scores[i] / max(tree.scores[top], 1e-9)))
    return out


@dataclass
class _Ahead:
    history: int  # tokens of the history the assumption starts from
    path: list[int]  # the path assumed accepted
    tree: DraftTree  # drafted after history + path


class RunAhead:
    """One stream's run-ahead trees, by sequence."""

    def __init__(self):
        self.trees: dict[str, _Ahead] = {}

    def draft(self, proposer: Proposer, steps: list[tuple[DraftJob, DraftTree]]) -> None:
        """Drafts ahead for the greedy sequences of the step just answered."""
        self.trees.clear()
        jobs, kept = [], []
        for job, tree in steps:
            path = likeliest_path(tree)
            if job.temperature == 0 and path:
                jobs.append(
                    replace(
                        job,
                        tokens=[*job.tokens, *path],
                        assumed=len(path),
                        # one more node each: the one for the target's token is cut off
                        budget=job.budget + (job.budget > 0),
                        deep_budget=job.free_budget + (job.free_budget > 0),
                    )
                )
                kept.append((job, path))
        if not jobs:
            return
        with metrics.RUN_AHEAD_SECONDS.time():
            trees = proposer.propose_ahead(jobs)
        for (job, path), tree in zip(kept, trees, strict=True):
            self.trees[job.seq_id] = _Ahead(len(job.tokens), path, tree)

    def take(self, job: DraftJob, accepted_len: int) -> DraftTree | None:
        """The sequence's tree from the run-ahead draft, if the step went as assumed: the
        message kept the history it was drafted after (accepted_len) and added the path and
        one of its first-level tokens."""
        ahead = self.trees.pop(job.seq_id, None)
        if ahead is None:
            return None
        new = job.tokens[ahead.history :]
        tops = [
            i
            for i, parent in enumerate(ahead.tree.parents)
            if parent == -1 and [*ahead.path, ahead.tree.token_ids[i]] == new
        ]
        if accepted_len != ahead.history or not tops:
            metrics.RUN_AHEAD.labels("discarded").inc()
            return None
        tree = subtree(ahead.tree, tops[0], node_limit(ahead.tree, job.budget, job.free_budget))
        if not tree:  # nothing under it, or this step wants no tree of that kind
            metrics.RUN_AHEAD.labels("discarded").inc()
            return None
        metrics.RUN_AHEAD.labels("used").inc()
        return tree

    def forget(self, seq_id: str) -> None:
        self.trees.pop(seq_id, None)
