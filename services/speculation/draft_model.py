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
import logging
import math
import time
from dataclasses import dataclass

import llguidance.torch
import numpy as np
import torch

from ..common.settings import ConfigError, DrafterSettings, ModelRef
from ..drafter.metrics import COMPILED_GRAPHS
from ..engine import models
from ..engine.batch import to_device
from ..engine.flat_model import CompileFailed, FlatModel, Segment, SequenceKV
from ..engine.head import keep_head_rows
from .grammar import Follower, GrammarError, Grammars, apply_masks
from .proposer import DraftCost, DraftJob, Proposer, TreeShape, shape_of
from .tree import DraftTree

log = logging.getLogger(__name__)


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


def model_path(settings: DrafterSettings):
    """The draft model's directory (fetched and verified)."""
    ref = settings.draft_model
    if settings.draft_model_path:
        ref = ModelRef(path=settings.draft_model_path)
    return models.resolve(ref, settings.model_cache_dir)[0]


def vocab_ids(tokenizer, vocab: int, keep: int) -> torch.Tensor:
    """The token ids a draft head of `keep` tokens computes, ascending: the `keep` lowest
    (the order a BPE tokenizer learned its tokens in, most frequent pairs first) and every
    added token (chat markers, end of text), all below `vocab`."""
    added = [i for i in tokenizer.added_tokens_decoder if keep <= i < vocab]
    return torch.tensor(sorted({*range(min(keep, vocab)), *added}), dtype=torch.long)


def keep_vocab(hf_model, tokenizer, keep: int) -> None:
    """Cuts the draft model's LM head to `vocab_ids` (logged); a head that cannot be cut is
    left whole, with a warning."""
    vocab = hf_model.config.vocab_size
    ids = vocab_ids(tokenizer, vocab, keep)
    if keep_head_rows(hf_model, ids):
        log.info("draft head cut", extra={"tokens": len(ids), "vocabulary": vocab})
    elif len(ids) < vocab:
        log.warning(
            "drafter.draft_vocab: this head's layout cannot be cut by rows; it stays whole",
            extra={"head": type(hf_model.get_output_embeddings()).__name__},
        )


def with_dtype(settings: DrafterSettings) -> DrafterSettings:
    """`settings` with `dtype: auto` replaced by what the device runs the draft model fastest
    in (models.resolve_dtype), so the registry and the load see the same dtype."""
    if settings.dtype != "auto":
        return settings
    dtype = models.resolve_dtype("auto", settings.device, model_path(settings), "drafter.dtype")
    return settings.model_copy(update={"dtype": dtype})


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(
        self,
        model: FlatModel,
        shape: TreeShape,
        sample_support: int = 32,
        grammars: Grammars | None = None,
    ):
        self.model = model
        self.shape = shape
        self.sample_support = sample_support  # q keeps this many most likely tokens
        self.states: dict[str, _DraftState] = {}
        # Requests with a grammar: a matcher each at its output, so that the draft model
        # drafts only what the grammar allows (the verifier masks the target the same way).
        self.grammars = grammars
        self.followers: dict[str, Follower] = {}

    @classmethod
    def from_settings(cls, settings: DrafterSettings) -> DraftModelProposer:
        path = model_path(settings)
        tokenizer = models.load_tokenizer(path)
        hf = models.load_model(path, settings.device, settings.dtype, setting="drafter.dtype")
        if settings.draft_vocab:
            keep_vocab(hf, tokenizer, settings.draft_vocab)
        try:
            model, _ = FlatModel.prepare(
                hf,
                compile=settings.compile,
                key="drafter.compile",
                on_graph=lambda _: COMPILED_GRAPHS.inc(),
            )
        except CompileFailed as e:
            raise ConfigError(str(e)) from e
        grammars = Grammars(tokenizer, hf.config.vocab_size)
        return cls(model, shape_of(settings), settings.sample_support, grammars)

    def forget(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)
        self.followers.pop(seq_id, None)

    def timed_cost(self, context: int = 64, reps: int = 3) -> DraftCost:
        """A level of a tree and a token of catch-up, timed on a scratch sequence of `context`
        tokens: its first tree (the whole context taken in), then trees of 1 and 3 nodes after
        one token each (levels = nodes, as the verifier's cost model counts them). The least
        of `reps` each: other work on the cores only slows a pass."""
        ids = list(range(100, 100 + context))  # (any tokens: the time does not depend on them)

        def timed(job: DraftJob) -> float:
            started = time.perf_counter()
            self.propose([job])
            return time.perf_counter() - started

        first = one = three = math.inf
        for r in range(reps):
            seq = f"timed-cost-{r}"
            try:
                first = min(first, timed(DraftJob(seq, ids, 1)))
                one = min(one, timed(DraftJob(seq, [*ids, ids[0]], 1)))
                three = min(three, timed(DraftJob(seq, [*ids, ids[0], ids[1]], 3)))
            finally:
                self.forget(seq)
        return DraftCost(max(0.0, (three - one) / 2), max(0.0, first - one) / context)

    def _follow(self, job: DraftJob) -> Follower | None:
        """The job's matcher at its output, if it has a grammar the drafter can follow."""
        if not job.grammar or self.grammars is None:
            return None
        follower = self.followers.get(job.seq_id)
        try:
            if follower is None:
                matcher = self.grammars.matcher(job.grammar)
                follower = Follower(matcher, self.grammars.tokenizer.eos_tokens)
        except GrammarError:  # (the verifier masks the target anyway)
            return None
        if not follower.follow(job.tokens[job.prompt_len :]):
            self.followers.pop(job.seq_id, None)
            return None
        self.followers[job.seq_id] = follower
        return follower

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        asked = jobs
        jobs = [j for j in jobs if j.budget > 0 and j.tokens]
        if not jobs:
            return [DraftTree() for _ in asked]
        root_logits = self.model.forward([self._sync(job) for job in jobs])
        rows = [logits[-1:] for logits in root_logits]  # [1, vocab] each
        followers = {job.seq_id: f for job in jobs if (f := self._follow(job)) is not None}
        if self.shape.branching == 1 and not followers:
            trees = self._chains(jobs, rows)
        else:  # (a grammar is followed level by level, on the host)
            trees = self._trees(jobs, rows, followers)
        for job in jobs:  # drop the tree's KV entries: rollback is a length
            state = self.states[job.seq_id]
            state.kv.truncate(len(state.tokens))
        by_id = {job.seq_id: tree for job, tree in zip(jobs, trees, strict=True)}
        return [by_id.get(j.seq_id, DraftTree()) for j in asked]

    def _trees(
        self,
        jobs: list[DraftJob],
        rows: list[torch.Tensor],
        followers: dict[str, Follower] | None = None,
    ) -> list[DraftTree]:
        """Grows each job's tree level by level from its root row; one read a level. A job
        with a grammar has its rows masked to what the grammar allows after each node's path
        (so q, when it samples, is the masked draft distribution it draws from)."""
        growths = []
        for job in jobs:
            gen = None
            if job.temperature > 0:
                gen = torch.Generator().manual_seed(job.seed)
            growths.append(_Growth(job, DraftTree(), [], {}, [-1], gen))
        self._grow(growths, rows, followers)
        for _ in range(1, self.shape.max_depth):
            active = [g for g in growths if g.frontier and len(g.tree) < g.job.budget]
            if not active:
                break
            logits = self.model.forward([self._frontier_segment(g) for g in active])
            self._grow(active, logits, followers)
        return [g.tree for g in growths]

    def _chains(self, jobs: list[DraftJob], rows: list[torch.Tensor]) -> list[DraftTree]:
        """Chains (branching 1): each level's tokens, the argmax of a greedy row or a draw
        from a sampled row's q, are the next pass's input on the device, so a chain of depth
        k is k - 1 forwards and one read at the end, whatever the batch. A job's chain is as
        long as the depth and its budget allow; a greedy chain's `min_path_prob` stop
        (`_expansion_floor`) is applied after the read (levels past it were computed and are
        dropped). The same
        trees, draws included, as `_trees` grows with branching 1 (q's probabilities equal up
        to rounding, which varies with the batch's shape)."""
        lengths = [min(self.shape.max_depth, job.budget) for job in jobs]
        gens = [
            torch.Generator().manual_seed(job.seed) if job.temperature > 0 else None for job in jobs
        ]
        rows = rows[0] if len(rows) == 1 else torch.cat(rows)  # [jobs, vocab]
        active = list(range(len(jobs)))  # the jobs drafting this level, in order
        levels = []  # per level: (active, its tensors to read)
        for level in range(max(lengths)):
            tokens, parts = self._chain_level(
                rows, [jobs[i] for i in active], [gens[i] for i in active]
            )
            levels.append((active, parts))
            going = [at for at, i in enumerate(active) if lengths[i] > level + 1]
            if not going:
                break
            if len(going) < len(active):
                tokens = tokens[to_device(np.array(going), tokens.device)]
            active = [active[at] for at in going]
            segments = [Segment(self.states[jobs[i].seq_id].kv, [0]) for i in active]
            rows = torch.cat(self.model.forward(segments, input_ids=tokens))
        host = read_together([part for _, parts in levels for part in parts])
        trees = [DraftTree() for _ in jobs]
        scores = [0.0] * len(jobs)
        for active, parts in levels:
            (picks, *dists), host = host[: len(parts)], host[len(parts) :]
            ids, probs = dists or (None, None)  # (a level of greedy rows only reads picks)
            for at, i in enumerate(active):
                tree = trees[i]
                if tree and scores[i] < self._expansion_floor(jobs[i]):
                    continue  # (its last node is not expanded: the chain ended there)
                if gens[i] is None:
                    token, p = int(picks[at][0]), math.exp(picks[at][1])
                else:
                    drawn = int(picks[at][0])
                    token, p = ids[at][drawn], probs[at][drawn]
                    tree.dists[len(tree) - 1] = (ids[at], probs[at])
                tree.add(token, len(tree) - 1)
                scores[i] += math.log(max(p, 1e-30))
        return trees

    def _chain_level(self, rows: torch.Tensor, jobs: list[DraftJob], gens: list):
        """One chain level on the device: rows [jobs, vocab] -> each job's next token [jobs],
        and what the host reads of it: [jobs, 2] picks (greedy: token and log-probability;
        sampled: the drawn index into q's support) and, where a row is sampled, [jobs,
        support] q's tokens and its probabilities."""
        best = torch.log_softmax(rows.float(), dim=-1).max(dim=-1)
        picks = torch.stack([best.indices.float(), best.values], dim=1)  # [jobs, 2]
        if all(g is None for g in gens):
            return best.indices, [picks]
        ids, probs = self._q(
            rows, [job.temperature if job.temperature > 0 else 1.0 for job in jobs]
        )
        support = probs.shape[1]
        half = torch.full((1, support), 0.5)  # (a greedy row's: its draw is not used)
        uniforms = torch.cat(
            [half if g is None else torch.rand((1, support), generator=g) for g in gens]
        )
        order = gumbel_order(probs, 1, to_device(uniforms, rows.device))  # [jobs, 1]
        drawn = ids.gather(1, order)[:, 0]
        sampled = to_device(np.array([g is not None for g in gens]), rows.device)
        tokens = torch.where(sampled, drawn, best.indices)
        picks = torch.where(sampled[:, None], order.float().expand(-1, 2), picks)
        return tokens, [picks, ids, probs]

    def _q(self, rows: torch.Tensor, temperatures: list[float]):
        """The draft distribution q of each row ([rows, vocab] logits): softmax(rows / T)
        over its `sample_support` most likely tokens -> ids and probs [rows, support]."""
        temps = to_device(np.array(temperatures, np.float32), rows.device)
        top = torch.topk(rows.float() / temps[:, None], self.sample_support)
        return top.indices, torch.softmax(top.values, dim=-1)

    def _grow(
        self,
        growths: list[_Growth],
        logits: list[torch.Tensor],
        followers: dict[str, Follower] | None = None,
    ) -> None:
        """One level: each growth's frontier rows of logits ([frontier, vocab] each) become
        its children, from one read of every row's choices."""
        rows = logits[0] if len(logits) == 1 else torch.cat(logits)
        if followers and any(g.job.seq_id in followers for g in growths):
            self._mask(rows, growths, followers)
        choices = iter(self._choices(rows, growths))
        for g in growths:
            self._expand(g, {node: next(choices) for node in g.frontier})

    def _mask(
        self, rows: torch.Tensor, growths: list[_Growth], followers: dict[str, Follower]
    ) -> None:
        """Masks, in place, each frontier row of a job with a grammar to what it allows
        after that node's path."""
        masks = llguidance.torch.allocate_token_bitmask(rows.shape[0], rows.shape[1])
        row = 0
        for g in growths:
            follower = followers.get(g.job.seq_id)
            for node in g.frontier:
                if follower is not None:
                    follower.fill(g.tree.path(node) if node >= 0 else [], masks, row)
                row += 1
        with torch.inference_mode():
            apply_masks(rows, masks)

    def _choices(self, rows: torch.Tensor, growths: list[_Growth]) -> list[_Choice]:
        """Each frontier row's candidate children, read from the device in one copy: a greedy
        row's `branching` most likely tokens; a sampled row's draft distribution q (its
        support) and the order of its Gumbel-top-k draws (uniforms from the job's generator,
        its rows in frontier order)."""
        kinds = [g.job.temperature > 0 for g in growths for _ in g.frontier]
        sampled = [i for i, s in enumerate(kinds) if s]
        greedy = [i for i, s in enumerate(kinds) if not s]
        parts = []  # [row, k] tensors, read together
        if greedy:
            picked = rows if not sampled else rows[to_device(np.array(greedy), rows.device)]
            top = torch.topk(torch.log_softmax(picked.float(), dim=-1), self.shape.branching)
            parts += [top.indices, top.values]
        if sampled:
            picked = rows if not greedy else rows[to_device(np.array(sampled), rows.device)]
            drawing = [g for g in growths if g.job.temperature > 0]
            ids, probs = self._q(picked, [g.job.temperature for g in drawing for _ in g.frontier])
            uniforms = torch.cat(
                [
                    torch.rand((len(g.frontier), probs.shape[1]), generator=g.generator)
                    for g in drawing
                ]
            )
            order = gumbel_order(probs, self.shape.branching, to_device(uniforms, rows.device))
            parts += [ids, probs, order]
        host = read_together(parts)
        out: list[_Choice | None] = [None] * len(kinds)
        if greedy:
            ids, logps = host[:2]
            for row, i in enumerate(greedy):
                out[i] = _Choice(ids[row], [math.exp(v) for v in logps[row]])
        if sampled:
            ids, probs, order = host[-3:]
            for row, i in enumerate(sampled):
                out[i] = _Choice(ids[row], probs[row], order[row])
        return out

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
        mask = np.zeros((n, fed + n), dtype=bool)  # over the entries after the prefix
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

    def _expand(self, g: _Growth, choice_of: dict[int, _Choice]) -> None:
        """Adds children of the frontier nodes; picks the next frontier."""
        job, shape = g.job, self.shape
        room = job.budget - len(g.tree)
        parent_score = {-1: 0.0} | dict(enumerate(g.score))
        groups = []  # per frontier node: [(score, token, parent)]
        for node in g.frontier:
            base = parent_score[node]
            choice = choice_of[node]
            if choice.order is not None:
                g.tree.dists[node] = (choice.ids, choice.probs)
                picks = [(choice.ids[i], choice.probs[i]) for i in choice.order]
            else:  # (a token of probability 0, which a grammar's mask makes, is no draft)
                picks = [(t, p) for t, p in zip(choice.ids, choice.probs, strict=True) if p > 0]
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


@dataclass
class _Choice:
    """A frontier node's candidate children, on the host."""

    ids: list[int]  # [k] token ids, most likely first
    probs: list[float]  # [k] their draft probabilities (sampled: q over its support)
    order: list[int] | None = None  # sampled: the children, drawn from q (indices into ids)


def read_together(tensors: list[torch.Tensor]) -> list[list]:
    """Several [rows, k] tensors read from their device in one copy (float64 holds token ids
    and float32 values exactly); each comes back as its nested lists, ids as ints."""
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        rows, k = t.shape
        values = flat[at : at + rows * k]
        if not t.is_floating_point():
            values = [int(v) for v in values]
        out.append([values[r * k : (r + 1) * k] for r in range(rows)])
        at += rows * k
    return out


def gumbel_order(probs: torch.Tensor, k: int, uniforms: torch.Tensor) -> torch.Tensor:
    """probs, uniforms [rows, n] -> [rows, min(k, n)]: each row's k draws without replacement
    from its probs, in draw order (Gumbel-top-k over the uniforms given).

    Always k of them: where fewer than k tokens have any probability, the rest are tokens
    of probability 0, which the verifier's acceptance skips. The count so never depends on
    the distribution, and through it on earlier draws."""
    keys = torch.log(probs) - torch.log(-torch.log(uniforms.clamp(1e-20, 1.0)))
    return torch.topk(keys, min(k, probs.shape[-1])).indices


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
