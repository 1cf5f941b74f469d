"""What one step runs: which sequences take part, and how many pending tokens each feeds."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .sequence import Committed, Sequence


@dataclass
class Part:
    """One sequence's part in a step."""

    seq: Sequence
    take: int  # pending tokens it feeds: all when decoding; a chunk of a prompt
    complete: bool  # its pending tokens are all in after this step, so it yields a token
    prefilling: bool  # it feeds prompt tokens
    was: Committed  # its progress before the step: what a failure rewinds to


@dataclass
class StepPlan:
    parts: list[Part]

    @property
    def seqs(self) -> list[Sequence]:
        return [p.seq for p in self.parts]

    @property
    def takes(self) -> list[int]:
        return [p.take for p in self.parts]

    @property
    def prefill_tokens(self) -> int:
        return sum(p.take for p in self.parts if p.prefilling)

    @property
    def first_token(self) -> bool:
        """An interactive prompt finishes its prefill: the step yields its first token."""
        return any(p.prefilling and p.complete and p.seq.queue == "interactive" for p in self.parts)


def plan_step(running: Iterable[Sequence], max_prefill_tokens: int) -> StepPlan:
    """The sequences that take part in this step (not cancelled, finished, paused or
    preempted), each
    with how many of its pending tokens it feeds: all of them when decoding; for a prompt, a
    chunk of the step's prefill budget (interactive prompts first)."""
    active = [
        s
        for s in running
        if not (s.cancelled or s.finish_reason or s.preempted) and s.paused_since is None
    ]
    budget = max_prefill_tokens
    parts = []
    for seq in sorted(active, key=lambda s: s.queue != "interactive"):
        take = seq.num_pending
        if seq.prefilling:
            take = min(take, budget)
            budget -= take
        if take:
            complete = take == seq.num_pending
            parts.append(Part(seq, take, complete, seq.prefilling, Committed.of(seq)))
    return StepPlan(parts)
