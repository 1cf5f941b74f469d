"""The `draft_model` proposer: a small causal LM grows a tree best-first by cumulative draft
probability, one batched forward pass per tree level (EAGLE-2's dynamic tree, Li et al. 2024).
Greedy requests expand each node by its top-k tokens; sampling requests draw each node's
children without replacement (Gumbel-top-k) from a truncated draft distribution q that is
sent with the tree, which keeps the verifier's rejection sampling exact. A sampling request's
tree has a shape fixed before any draw (no `min_path_prob` stop, a fixed number of children),
so its size and drafting time, and with them whether the verifier gets it in time, do not
depend on what was drawn. A chain is branching=1."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from ..common import models
from ..common.proposers.base import DraftJob, Proposer, TreeShape, shape_of
from ..common.settings import ConfigError, DrafterSettings, ModelRef
from ..common.tree import DraftTree
from ..engine.flat_model import CompileFailed, FlatModel, Segment, SequenceKV
from .metrics import COMPILED_GRAPHS


@dataclass
class _DraftState:
    kv: SequenceKV
    tokens: list[int]  # tokens whose KV entries are valid, in order


@dataclass
class _Growth:
    """A tree being grown for one job."""

    job: DraftJob
    tree: DraftTree
    score: list[float]  # [nodes] cumulative draft log-probability
    slot: dict[int, int]  # node -> KV offset after the committed prefix, once fed
    frontier: list[int]  # nodes to expand next
    generator: torch.Generator | None


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, model: FlatModel, shape: TreeShape, sample_support: int = 32):
        self.model = model
        self.shape = shape
        self.sample_support = sample_support  # q keeps this many most likely tokens
        self.states: dict[str, _DraftState] = {}

    @classmethod
    def from_settings(cls, settings: DrafterSettings) -> DraftModelProposer:
        ref = settings.draft_model
        if settings.draft_model_path:
            ref = ModelRef(path=settings.draft_model_path)
        path, _ = models.resolve(ref, settings.model_cache_dir)
        try:
            model, _ = FlatModel.prepare(
                models.load_model(path, settings.device, settings.dtype, setting="drafter.dtype"),
                compile=settings.compile,
                key="drafter.compile",
                on_graph=lambda _: COMPILED_GRAPHS.inc(),
            )
        except CompileFailed as e:
            raise ConfigError(str(e)) from e
        return cls(model, shape_of(settings), settings.sample_support)

    def forget(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        asked = jobs
        jobs = [j for j in jobs if j.budget > 0 and j.tokens]
        if not jobs:
            return [DraftTree() for _ in asked]
        root_logits = self.model.forward([self._sync(job) for job in jobs])
        growths = []
        for job, logits in zip(jobs, root_logits, strict=True):
            gen = None
            if job.temperature > 0:
                gen = torch.Generator().manual_seed(job.seed)
            growth = _Growth(job, DraftTree(), [], {}, [-1], gen)
            self._expand(growth, {-1: logits[-1]})
            growths.append(growth)
        for _ in range(1, self.shape.max_depth):
            active = [g for g in growths if g.frontier and len(g.tree) < g.job.budget]
            if not active:
                break
            logits = self.model.forward([self._frontier_segment(g) for g in active])
            for g, rows in zip(active, logits, strict=True):
                self._expand(g, dict(zip(g.frontier, rows, strict=True)))
        for job in jobs:  # drop the tree's KV entries: rollback is a length
            state = self.states[job.seq_id]
            state.kv.truncate(len(state.tokens))
        by_id = {g.job.seq_id: g.tree for g in growths}
        return [by_id.get(j.seq_id, DraftTree()) for j in asked]

    def _sync(self, job: DraftJob) -> Segment:
        """Rolls the draft cache back to what it shares with the history; feeds the rest."""
        state = self.states.get(job.seq_id)
        if state is None:
            state = self.states[job.seq_id] = _DraftState(self.model.new_kv(), [])
        keep = _common_prefix(state.tokens, job.tokens)
        keep = min(keep, len(job.tokens) - 1)  # the last token is fed for its logits
        state.kv.truncate(keep)
        state.tokens = list(job.tokens)
        return Segment(state.kv, job.tokens[keep:])

    def _frontier_segment(self, g: _Growth) -> Segment:
        """The frontier nodes as new tokens that see the prefix and their fed ancestors."""
        kv = self.states[g.job.seq_id].kv
        committed = len(self.states[g.job.seq_id].tokens)
        fed = kv.length - committed
        n = len(g.frontier)
        mask = torch.zeros(n, fed + n, dtype=torch.bool)  # over the entries after the prefix
        depths = g.tree.depths()
        for row, node in enumerate(g.frontier):
            mask[row, fed + row] = True
            parent = g.tree.parents[node]
            while parent >= 0:
                mask[row, g.slot[parent]] = True
                parent = g.tree.parents[parent]
            g.slot[node] = fed + row
        return Segment(
            kv,
            [g.tree.token_ids[node] for node in g.frontier],
            positions=[committed + depths[node] for node in g.frontier],
            mask=mask,
            mask_from=committed,
            logits_from=0,
        )

    def _expand(self, g: _Growth, logits_of: dict[int, torch.Tensor]) -> None:
        """Adds children of the frontier nodes; picks the next frontier."""
        job, shape = g.job, self.shape
        room = job.budget - len(g.tree)
        parent_score = {-1: 0.0} | dict(enumerate(g.score))
        groups = []  # per frontier node: [(score, token, parent)]
        for node in g.frontier:
            base = parent_score[node]
            if job.temperature > 0:
                ids, probs = self._draft_dist(logits_of[node], job.temperature)
                g.tree.dists[node] = (ids.tolist(), probs.tolist())
                order = _gumbel_top_k(probs, shape.branching, g.generator)
                picks = [(int(ids[i]), float(probs[i])) for i in order]
            else:
                logp = torch.log_softmax(logits_of[node], dim=-1)
                top = torch.topk(logp, shape.branching)
                picks = [(int(t), math.exp(float(v))) for v, t in zip(*top, strict=True)]
            groups.append([(base + math.log(max(p, 1e-30)), t, node) for t, p in picks])
        if job.temperature > 0:
            # Whole groups in frontier order: a node's children must be a prefix of its draws
            # whose length does not depend on what was drawn, or the verifier would be biased.
            chosen = [c for group in groups for c in group][:room]
        else:
            chosen = heapq.nlargest(min(room, shape.width), (c for grp in groups for c in grp))
        added = []
        for score, token, parent in chosen:
            added.append(g.tree.add(token, parent))
            g.score.append(score)
        floor = self._expansion_floor(job)
        promising = [n for n in added if g.score[n] >= floor]
        g.frontier = heapq.nlargest(shape.width, promising, key=lambda n: g.score[n])

    def _expansion_floor(self, job: DraftJob) -> float:
        """The least cumulative log-probability a node needs to be expanded.

        Greedy drafts stop where the path gets unlikely. Sampled drafts never do: a stop that
        looks at what was drawn would make the tree's depth, hence its drafting time, hence
        whether it beats the verifier's deadline, depend on the draws, and a tree dropped more
        often for some draws than for others biases the output (see "The speculative step")."""
        if job.temperature > 0 or self.shape.min_path_prob <= 0:
            return -math.inf
        return math.log(self.shape.min_path_prob)

    def _draft_dist(self, logits: torch.Tensor, temperature: float):
        """q: softmax(logits / T) over the top `sample_support` tokens, renormalised."""
        top = torch.topk(logits.float() / temperature, self.sample_support)
        return top.indices.cpu(), torch.softmax(top.values, dim=-1).cpu()


def _gumbel_top_k(probs: torch.Tensor, k: int, generator) -> list[int]:
    """Indices of k draws without replacement from probs, in draw order (Gumbel-top-k).

    Always k of them: where fewer than k tokens have any probability, the rest are tokens
    of probability 0, which the verifier's acceptance skips. The count so never depends on
    the distribution, and through it on earlier draws."""
    u = torch.rand(probs.shape, generator=generator).clamp_(1e-20, 1.0)
    keys = torch.log(probs) - torch.log(-torch.log(u))
    return torch.topk(keys, min(k, len(probs))).indices.tolist()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
