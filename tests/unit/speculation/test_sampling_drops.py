"""Sampling stays exact when late trees are dropped.

The verifier drops a tree that misses `draft_timeout_seconds`, and a deeper tree takes longer
to draft. If a sampled tree's depth depended on its draws, the trees that arrive in time
would be a biased sample of the draws, and the output would leave the target's distribution.
Here the real draft-model proposer and the real acceptance rule, with target logits from the
real tiny target, emit two tokens per trial while deep trees are dropped most of the time;
the emitted pairs must follow the exact two-token target distribution. The same harness with
the draw-dependent shape rule (sampled trees stopped below `min_path_prob`) must fail."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from conftest import DEVICE
from specserve.engine.flat_model import FlatModel
from specserve.speculation.acceptance import Candidates, select
from specserve.speculation.draft_model import DraftModelProposer
from specserve.speculation.proposer import DraftJob, TreeShape
from specserve.speculation.sampling import SamplingParams, target_probs
from specserve.speculation.tree import DraftTree

PROMPT = [5, 17, 99, 3, 42]
PARAMS = SamplingParams(temperature=0.5, top_k=4)  # 4 x 4 two-token outcomes
SHAPE = TreeShape(max_depth=3, branching=1, width=1, min_path_prob=0.2)
BUDGET = 3
DEEP = 2  # a tree of at least this many levels ...
DROP = 0.7  # ... misses the deadline this often
TRIALS = 2500  # power: over 20 seed pairs, the exact rule passed (p > 0.01) 20 times and
# the draw-dependent one failed all 20 (its largest p: 1e-14; TV 0.1 against 0.02)
LANES = 64
DRAFT_NOISE = 0.2


class DrawDependentProposer(DraftModelProposer):
    """The shape rule before: sampled trees stop where the drawn path gets unlikely."""

    def _expansion_floor(self, job: DraftJob) -> float:
        return math.log(self.shape.min_path_prob)


class Target:
    """Target probabilities after a token history (HF forward of the tiny target, memoised:
    the target is deterministic, and trials revisit the same few paths). Rows come back on the
    CPU, with the trials' one generator (acceptance runs wherever its rows are)."""

    def __init__(self, model):
        self.model = model
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, history: list[int]) -> torch.Tensor:
        key = tuple(history)
        if key not in self.rows:
            with torch.no_grad():
                ids = torch.tensor([history], device=self.model.device)
                self.rows[key] = self.model(ids).logits[0, -1].float().cpu()
        return self.rows[key]

    def probs(self, history: list[int]) -> torch.Tensor:
        return target_probs(self.logits(history), PARAMS)


def tiny_qwen(noise: float = 0.0):
    """A 2-layer random Qwen2 with a 256-token vocabulary (small enough to draft and verify
    thousands of times in seconds) on the tests' device; with noise, each weight of that same
    model is perturbed by noise * its tensor's std (drawn on the CPU: the same on any device)."""
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(noise * param.std() * torch.randn_like(param))
    return model.to(DEVICE).eval()


@pytest.fixture(scope="module")
def target_model():
    return tiny_qwen()


@pytest.fixture(scope="module")
def draft_model():
    """Near the target, so its drafts are often accepted and a biased draw would show (the
    tests' usual tiny draft shares no likely token with its target)."""
    return tiny_qwen(DRAFT_NOISE)


@dataclass
class Tally:
    pairs: dict[tuple[int, int], int] = field(default_factory=dict)  # emitted first two tokens
    steps: int = 0
    used: int = 0  # steps whose tree came in time
    accepted: int = 0  # draft tokens kept


@dataclass
class Lane:
    """One sequence slot of the batch: it runs trials one after another."""

    seq_id: str
    history: list[int] = field(default_factory=lambda: list(PROMPT))
    out: list[int] = field(default_factory=list)


def emit_pairs(proposer, target: Target, gen, drops, tally: Tally) -> None:
    """TRIALS times, decodes two tokens as the verifier does: draft, drop a deep tree DROP of
    the time (the deadline), accept, repeat until two tokens are out. LANES trials run side by
    side, each step one proposer call and one acceptance call for all of them, as a drafter
    and a verifier batch their sequences; each trial draws with seeds of its own."""
    lanes = [Lane(f"s{i}") for i in range(min(LANES, TRIALS))]
    started = len(lanes)
    while lanes:
        seeds = [int(torch.randint(2**62, (), generator=gen)) for _ in lanes]
        jobs = [
            DraftJob(lane.seq_id, lane.history, BUDGET, PARAMS.temperature, seed)
            for lane, seed in zip(lanes, seeds, strict=True)
        ]
        candidates = []
        for lane, tree in zip(lanes, proposer.propose(jobs), strict=True):
            levels = max(tree.depths(), default=-1) + 1
            if levels >= DEEP and float(torch.rand((), generator=drops)) < DROP:
                tree = DraftTree()  # too late: the step runs without it
            rows = [target.logits(lane.history)]
            rows += [target.logits(lane.history + tree.path(n)) for n in range(len(tree))]
            candidates.append(Candidates(tree, torch.stack(rows), PARAMS, gen))
        next_lanes = []
        for lane, c, verdict in zip(lanes, candidates, select(candidates), strict=True):
            tally.steps += 1
            tally.used += len(c.tree) > 0
            tally.accepted += len(verdict.accepted)
            lane.out += verdict.tokens
            lane.history += verdict.tokens
            if len(lane.out) >= 2:
                pair = (lane.out[0], lane.out[1])
                tally.pairs[pair] = tally.pairs.get(pair, 0) + 1
                if started == TRIALS:
                    continue
                started += 1
                lane.history, lane.out = list(PROMPT), []
            next_lanes.append(lane)
        lanes = next_lanes


def exact_pairs(target: Target) -> dict[tuple[int, int], float]:
    first = target.probs(PROMPT)
    pairs = {}
    for a in torch.nonzero(first).flatten().tolist():
        second = target.probs(PROMPT + [a])
        for b in torch.nonzero(second).flatten().tolist():
            pairs[(a, b)] = float(first[a] * second[b])
    return pairs


def chi_square_p(counts: dict[tuple[int, int], int], exact: dict[tuple[int, int], float]):
    """Pearson's chi-square p-value of the counts against the exact distribution."""
    assert set(counts) <= set(exact), "a pair the target cannot emit was emitted"
    n = sum(counts.values())
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    df = len(exact) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


@pytest.fixture
def one_thread():
    """One intra-op thread: these passes are tiny, and on a busy machine a second thread
    only waits (20x slower here under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run(proposer_cls, target_model, draft_model) -> tuple[float, Tally]:
    """The chi-square p-value of TRIALS emitted pairs, and what happened on the way."""
    proposer = proposer_cls(FlatModel(draft_model), SHAPE, sample_support=8)
    target = Target(target_model)
    gen, drops = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    tally = Tally()
    emit_pairs(proposer, target, gen, drops, tally)
    exact = exact_pairs(target)
    p_value = chi_square_p(tally.pairs, exact)
    tv = sum(abs(tally.pairs.get(k, 0) / TRIALS - p) for k, p in exact.items()) / 2
    print(
        f"\n{proposer_cls.__name__}: p={p_value:.3g} TV={tv:.3f} steps={tally.steps} "
        f"trees used={tally.used} drafts accepted={tally.accepted}"
    )
    return p_value, tally


def test_dropping_late_trees_keeps_sampling_exact(one_thread, target_model, draft_model):
    p_value, tally = run(DraftModelProposer, target_model, draft_model)
    assert p_value > 0.01
    # Not vacuous: trees were used in about 1 - DROP of the steps, and drafts accepted.
    assert 0.2 * tally.steps < tally.used < 0.4 * tally.steps
    assert tally.accepted > 0.3 * tally.used


def test_the_check_catches_drops_that_depend_on_the_draws(one_thread, target_model, draft_model):
    p_value, _ = run(DrawDependentProposer, target_model, draft_model)
    assert p_value < 0.01


def test_sampled_trees_have_one_shape_whatever_is_drawn(draft_model):
    """The shape (hence the drafting time) of a sampled tree depends on the history and the
    budget only; a greedy tree still stops where its path gets unlikely."""
    proposer = DraftModelProposer(FlatModel(draft_model), SHAPE, sample_support=8)
    shapes = {
        tuple(proposer.propose([DraftJob("s", PROMPT, BUDGET, 0.5, seed)])[0].parents)
        for seed in range(40)
    }
    assert shapes == {(-1, 0, 1)}
    (greedy,) = proposer.propose([DraftJob("s", PROMPT, BUDGET)])
    assert len(greedy) < BUDGET  # this draft is never sure enough to go on
