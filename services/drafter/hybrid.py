"""The `hybrid` proposer: n-gram where the history repeats itself, the draft model elsewhere."""

from __future__ import annotations

from dataclasses import replace

from ..common.settings import DrafterSettings
from ..common.tree import DraftTree
from .draft_model import DraftModelProposer
from .ngram import NgramProposer
from .proposer import DraftJob, Proposer


class HybridProposer(Proposer):
    """N-gram drafts where the history predicts itself (a suffix of at least `trust_ngram`
    tokens occurred before: copying code or quotes), the draft model everywhere else. Steps
    that copy cost no draft forward pass at all."""

    name = "hybrid"

    def __init__(self, ngram: NgramProposer, draft: DraftModelProposer, trust_ngram: int = 3):
        self.ngram, self.draft, self.trust_ngram = ngram, draft, trust_ngram

    @classmethod
    def from_settings(cls, settings: DrafterSettings) -> HybridProposer:
        return cls(
            NgramProposer.from_settings(settings),
            DraftModelProposer.from_settings(settings),
            settings.trust_ngram,
        )

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        looked_up = [self.ngram.lookup(job.tokens, job.budget) for job in jobs]
        copying = [len(tree) > 0 and n >= self.trust_ngram for tree, n in looked_up]
        drafted = self.draft.propose(
            [
                replace(job, budget=0) if copy else job
                for job, copy in zip(jobs, copying, strict=True)
            ]
        )
        return [
            lookup[0] if copy else tree
            for lookup, copy, tree in zip(looked_up, copying, drafted, strict=True)
        ]

    def forget(self, seq_id: str) -> None:
        self.draft.forget(seq_id)
