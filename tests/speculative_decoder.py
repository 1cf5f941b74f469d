"""The verifier's step without the service around it, over the real proposers and engine:
the speculative decoder that the engine's and speculation's tests compare with the target."""

from __future__ import annotations

from helpers import make_sequence
from specserve.engine.flat_model import FlatModel
from specserve.speculation.acceptance import accept
from specserve.speculation.proposer import DraftJob
from specserve.verifier.runner import ModelRunner

PROMPTS = [
    [9707, 11, 1879, 0, 9707, 11, 1879, 0, 9707],
    [750, 75698, 1445, 982, 262, 470],
    [1, 2, 3, 4, 5, 1, 2, 3],
    [151, 7000, 42, 42, 42, 42],
    [100, 200, 300],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [314, 15, 159, 265],
    [88, 99, 88, 99, 88],
]


def speculative_greedy(target, proposer, prompts, max_tokens: int, budget: int, eos: int):
    """The verifier's step without the service around it: draft, verify, accept, commit."""
    runner = ModelRunner(FlatModel(target))
    seqs = [make_sequence(p, max_tokens=max_tokens, rid=f"r{i}") for i, p in enumerate(prompts)]

    def finished(seq):
        return len(seq.output_ids) >= seq.max_tokens or seq.output_ids[-1] == eos

    active, steps = list(seqs), 0
    while active:
        jobs = [
            DraftJob(s.request_id, s.all_ids, min(budget, s.max_tokens - len(s.output_ids) - 1))
            for s in active
        ]
        trees = proposer.propose(jobs)
        for tree, job in zip(trees, jobs, strict=True):
            assert len(tree) <= job.budget
        for seq, tree, logits in zip(active, trees, runner.verify(active, trees), strict=True):
            verdict = accept(tree, logits, seq.params, None)
            runner.commit(seq, tree, verdict.accepted)
            seq.extend(verdict.tokens, finished)
        for seq in active:
            if finished(seq):  # what the drafter does when told a sequence completed
                proposer.learn("", seq.all_ids, len(seq.prompt_ids))
                proposer.forget(seq.request_id)
        active = [s for s in active if not finished(s)]
        steps += 1
    return [s.output_ids for s in seqs], steps
