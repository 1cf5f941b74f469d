"""The `hybrid` proposer: per sequence and step, the suffix tree's draft or the draft model's,
whichever is expected to have more tokens accepted."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..common.settings import DrafterSettings
from .draft_model import DraftModelProposer
from .proposer import DraftCost, DraftJob, Proposer
from .suffix import SuffixProposer
from .tree import DraftTree, union

PRIOR_MODEL_ACCEPTED = 1.5  # draft tokens a draft-model tree gets accepted, before measuring
SEQUENCE_WEIGHT = 0.3  # of a step in a sequence's running mean
SERVICE_WEIGHT = 0.05  # of a step in the drafter-wide means


@dataclass
class _Proposed:
    tree: DraftTree  # the tree proposed
    history: int  # tokens of the history it was drafted after
    suffix: DraftTree  # the suffix tree, proposed or not
    predicted: float  # its score
    model: DraftTree  # the draft model's tree, proposed or part of the one proposed (or empty)


@dataclass
class _Calibration:
    """Running means of what suffix trees got accepted and what they scored."""

    actual: float = 1.0
    predicted: float = 1.0

    def update(self, actual: float, predicted: float, weight: float) -> None:
        self.actual += weight * (actual - self.actual)
        self.predicted += weight * (predicted - self.predicted)

    @property
    def ratio(self) -> float:
        return self.actual / self.predicted


class HybridProposer(Proposer):
    """The suffix tree's expectation is its score (its nodes' discounted path frequencies),
    scaled by how well scores have come true for the sequence: a running ratio of what its
    suffix trees got accepted to what they scored, starting from the drafter-wide ratio. The
    draft model's is the sequence's running mean of accepted tokens on its draft-model steps
    (before its first: the drafter-wide mean). Sampling requests use neither drafter-wide
    figure, so that their trees depend on their own history only. What was accepted is read
    off the next message: the new tokens that follow a path of the tree proposed for them.

    The suffix tree is scored on every step, the proposed one or not: a step that went to the
    draft model still shows how many of its emitted tokens the suffix tree held (at most those
    emitted, so an unproposed tree that would have done better counts as no better than the
    step). A drafter-wide ratio alone mixes kinds of text: on the replayed Spec-Bench answers,
    suffix trees scoring 1-3 after short matches in prose got a fifth of their score accepted
    and ones scoring 6 or more in code edits twice theirs, and prose sequences kept taking the
    former over the draft model.

    Steps that take the suffix tree alone (the draft model's budget is 0, or a sampling
    request's suffix tree won) cost no draft forward pass, and may go as deep as the
    verifier's `deep_budget`; the draft model's trees stay within `budget`, and a greedy
    step whose suffix tree won while the draft model has a budget proposes both as one tree
    within the larger of the two (`_choose`)."""

    name = "hybrid"

    def __init__(self, suffix: SuffixProposer, draft: DraftModelProposer):
        self.suffix, self.draft = suffix, draft
        self.proposed: dict[str, _Proposed] = {}
        self.model_accepted: dict[str, float] = {}  # per sequence
        self.service_model_accepted = PRIOR_MODEL_ACCEPTED
        self.calibration: dict[str, _Calibration] = {}  # per sequence
        self.service_calibration = _Calibration()

    @classmethod
    def from_settings(cls, settings: DrafterSettings) -> HybridProposer:
        return cls(
            SuffixProposer.from_settings(settings), DraftModelProposer.from_settings(settings)
        )

    def timed_cost(self) -> DraftCost | None:
        return self.draft.timed_cost()

    def _calibration(self, job: DraftJob) -> _Calibration:
        """How far the sequence's suffix scores have come true. Sampling requests start from
        none of the drafter's history: their trees, and so a seeded request's output, depend
        on their own only."""
        if job.seq_id not in self.calibration:
            start = self.service_calibration if job.temperature == 0 else _Calibration()
            self.calibration[job.seq_id] = replace(start)
        return self.calibration[job.seq_id]

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        for job in jobs:
            self._observe(job)
        chosen = self._choose(jobs)
        for job, (tree, suffix, score, model) in zip(jobs, chosen, strict=True):
            self.proposed[job.seq_id] = _Proposed(tree, len(job.tokens), suffix, score, model)
        return [tree for tree, *_ in chosen]

    def propose_ahead(self, jobs: list[DraftJob]) -> list[DraftTree]:
        """Chooses as propose does, and leaves the record of the last real proposal alone: its
        acceptance is read off the next message."""
        return [tree for tree, *_ in self._choose(jobs)]

    def _choose(self, jobs: list[DraftJob]) -> list[tuple[DraftTree, DraftTree, float, DraftTree]]:
        """Each job's tree, its suffix tree and that tree's score, and the draft model's tree.

        A greedy sequence whose suffix tree wins while the draft model has a budget gets both
        in one tree (`tree.union`: the chain, then the suffix tree's likeliest nodes within
        the larger budget): the draft model's passes were priced for that step anyway, and
        either tree alone loses steps the other would have won (on the acceptance replay,
        2-4 steps a category, where a confident suffix tree got 0-3 tokens and the chain
        would have got 1-6). Sampling requests take one or the other, since a drawn tree's
        children must all come from its draft distribution."""
        suffixed = [self.suffix.propose_one(job) for job in jobs]
        use_suffix = [
            len(tree) > 0
            and (job.budget == 0 or score * self._calibration(job).ratio >= self._model(job))
            for job, (tree, score) in zip(jobs, suffixed, strict=True)
        ]
        both = [
            s and job.budget > 0 and job.temperature == 0
            for job, s in zip(jobs, use_suffix, strict=True)
        ]
        drafted = self.draft.propose(
            [
                replace(job, budget=0) if s and not b else job
                for job, s, b in zip(jobs, use_suffix, both, strict=True)
            ]
        )
        chosen = []
        for job, (tree, score), s, b, model in zip(
            jobs, suffixed, use_suffix, both, drafted, strict=True
        ):
            if b:
                proposed = union(model, tree, max(job.budget, job.free_budget))
            else:
                proposed = tree if s else model
            chosen.append((proposed, tree, score, model))
        return chosen

    def _model(self, job: DraftJob) -> float:
        """The draft model's expected accepted tokens for the sequence (sampling requests:
        from their own steps and a fixed prior only, as above)."""
        prior = self.service_model_accepted if job.temperature == 0 else PRIOR_MODEL_ACCEPTED
        return self.model_accepted.get(job.seq_id, prior)

    def _observe(self, job: DraftJob) -> None:
        """Updates the means with what the target kept of the sequence's last tree."""
        last = self.proposed.pop(job.seq_id, None)
        if last is None or len(job.tokens) <= last.history:
            return
        emitted = job.tokens[last.history :]
        if len(last.suffix) > 0:
            held = last.suffix.matched(emitted)
            self._calibration(job).update(held, last.predicted, SEQUENCE_WEIGHT)
            if job.temperature == 0:
                self.service_calibration.update(held, last.predicted, SERVICE_WEIGHT)
        if len(last.model) == 0:
            return
        accepted = last.model.matched(emitted)
        mean = self._model(job)
        self.model_accepted[job.seq_id] = mean + SEQUENCE_WEIGHT * (accepted - mean)
        self.service_model_accepted += SERVICE_WEIGHT * (accepted - self.service_model_accepted)

    def forget(self, seq_id: str) -> None:
        self.draft.forget(seq_id)
        self.suffix.forget(seq_id)
        self.proposed.pop(seq_id, None)
        self.model_accepted.pop(seq_id, None)
        self.calibration.pop(seq_id, None)

    def learn(self, tenant: str, tokens: list[int], prompt_len: int) -> None:
        self.suffix.learn(tenant, tokens, prompt_len)

    def learned_tokens(self) -> int:
        return self.suffix.learned_tokens()
