"""Gets a draft tree for every running sequence each step: from the sequence's drafter over
that drafter's bidirectional stream, or, when the drafter fails, is late or its breaker is
open, from the fallback (no tree = plain decoding, or local n-gram drafts). The tree sizes come
from the policy (fixed, or adaptive), which learns from what the target kept of each tree:
of a model-free tree not checked in full too, once the tokens that follow decide its other
nodes (the sequence's shadow).

The pieces it drives: the drafters and which sequence drafts where (`drafter_pool`), each
drafter's stream (`drafter_client`) and breaker (`breaker`), and what each stream has been
told (`drafter_sync`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ..common.settings import BatchSettings, SpeculationSettings
from ..speculation.ngram import NgramProposer
from ..speculation.policy import EXPLORE_ALPHA, AdaptivePolicy, Candidate
from ..speculation.proposer import TreeShape
from ..speculation.tree import DraftTree, from_proto, node_limit
from . import metrics
from .drafter_client import DraftUnavailable
from .drafter_pool import DrafterPool
from .drafter_sync import DrafterSync
from .sequence import Sequence, Shadow

log = logging.getLogger(__name__)

EXPLORE_TOKENS = 8  # draft tokens of a kind checked before a sequence's own rate is trusted
EXPLORE_TREES = 3  # ... or model-free trees checked
# Nodes of a model-free tree while it explores: three trees of 7 nodes (what an acceptance of
# 0.8 pays for) took 107 ms a step against 50 for one token on this CPU, and a 14-token answer
# whose matches the target all rejected ran at 0.73x plain; a tree of 3 tests acceptance as
# well (a rejection ends it at any depth), and a copying sequence goes deep once measured.
EXPLORE_DEPTH = 3
# Tokens a draft model's catch-up is charged over (AdaptivePolicy.budgets), at most: the catch-up
# comes before a sequence's first draft-model tree, while it explores (priced at EXPLORE_ALPHA),
# and is only known to buy that exploration (about this many tokens emitted while EXPLORE_TOKENS
# drafts are checked); afterwards the sequence drafts only where its measured rate pays. Spread
# over a whole 96-token answer instead, exploring 12 streams at once rode on prompt-chunk steps
# (their draft-model catch-ups took 2.6-5.9 s a step) and 13 streams ran at 0.85x plain.
CATCH_UP_HORIZON = 2 * EXPLORE_TOKENS
# Token counts of a forward pass timed at start for the verify profile (policy.py): every
# count of one sequence's small trees (kernels price rows in blocks), then sparser.
CALIBRATE_COUNTS = (*range(1, 10), 13, 17, 25, 33, 49, 65)
CALIBRATE_MAX = 65
# A count timed at more than SLOWED x a larger count's time was slowed by other work, and is
# timed again (up to CALIBRATE_RETRIES times, the least kept): a pass of more tokens does not
# take much less time. Unchecked, a verifier starting beside the gateway and scheduler timed 1
# and 2 tokens at 659 and 704 ms against 69 for 3; read non-decreasing, that profile priced a
# token at 217 ms and every node up to 13 tokens at nothing, and 16 streams drafted trees that
# kept 0.38 tokens a node.
SLOWED = 1.2
CALIBRATE_RETRIES = 2
# Steps a sequence waits, at most, before asking the drafter for a model-free tree alone
# again, after asks that left nothing worth checking (1, 3, 7, then this many): an ask is a
# round trip (2-6 ms against a 50 ms step here), and prose found nothing in most of them,
# while a copy that starts is found within this many tokens. The round trip is the step's,
# whichever sequences ask in it, so the asks of a sequence that waits p - 1 steps fall on the
# verifier's steps that are multiples of p (Speculator._asked_alone): each on a clock of its
# own, sixteen streams asked in a quarter of their steps (5.5 ms a round trip against 165 ms
# steps, on a Xeon); together, in an eighth.
FREE_WAIT_MAX = 15


def exploring(tested: int, trees: int | None = None) -> bool:
    """Whether a sequence's drafts of a kind are still being measured: fewer than
    EXPLORE_TOKENS of them checked, or for model-free trees (`trees` given) fewer than
    EXPLORE_TREES trees. A suffix match that the target rejects at its first token is one
    token checked; on prose such matches came a few in a hundred steps, so exploring until 8
    tokens lasted the whole answer, every step asking the drafter (a round trip, ~2 ms here)
    at the optimistic price, and the default config ran at 0.94x plain."""
    return tested < EXPLORE_TOKENS and (trees is None or trees < EXPLORE_TREES)


def explored(alpha: float, tested: int, trees: int | None = None) -> float:
    """A sequence's acceptance as the policy prices it: at least EXPLORE_ALPHA while
    `exploring`."""
    return max(alpha, EXPLORE_ALPHA) if exploring(tested, trees) else alpha


@dataclass
class _StepPrice:
    """What the policy priced the step's model-free trees by (Speculator._priced)."""

    rate: float  # expected emitted tokens per second of the step without them
    tokens: int  # tokens of its pass without them
    deep: list[int]  # per sequence, the deep budget priced by its acceptance


class Speculator:
    """What the engine asks of speculation: each step's trees (`propose`), what the step
    taught the policy (`observe_step`, `observe_acceptance`), and that a sequence ended
    (`forget`)."""

    def __init__(
        self,
        settings: SpeculationSettings,
        batch: BatchSettings,
        vocab_size: int,
        discover=None,
    ):
        self.enabled = settings.speculative_decoding
        self.tree_size = settings.verification_tree_size
        self.deep_tree_size = settings.deep_tree_size
        self.timeout = settings.draft_timeout_seconds
        self.max_seq_len = batch.max_seq_len
        self.batch_size = batch.batch_size
        self.vocab_size = vocab_size
        self.pool = (
            DrafterPool(
                settings.drafter_addresses,
                discover if settings.discover_drafters else None,
                (settings.breaker_failures, settings.breaker_cooldown_seconds),
            )
            if self.enabled
            else None
        )
        self.policy = (
            AdaptivePolicy(self.tree_size) if settings.speculation_policy == "adaptive" else None
        )
        self.fallback = (
            NgramProposer(TreeShape(max_depth=8)) if settings.fallback_mode == "ngram" else None
        )
        self.sync = DrafterSync()
        self._step: _StepPrice | None = None  # what `budgets` priced this step by
        self.steps = 0  # steps priced (`budgets` calls): the clock model-free asks keep

    def cap(self, seq: Sequence, size: int | None = None) -> int:
        """Most tree nodes a sequence may get (`size`, or verification_tree_size; a request's
        pinned tree_size, up to the larger of verification_tree_size and deep_tree_size): none
        when off, and never more than could be emitted (so the KV reservation holds).

        None while the prompt is prefilled either: the first token then does not wait for the
        drafter to prefill the prompt too (that happens with the second step)."""
        if not (self.enabled and seq.speculate) or seq.prefilling:
            return 0
        size = self.tree_size if size is None else size
        if seq.tree_size is not None:  # a pin, within the operator's largest tree
            size = min(seq.tree_size, max(self.tree_size, self.deep_tree_size))
        generated = len(seq.output_ids)
        room = min(seq.max_tokens - generated, self.max_seq_len - len(seq.prompt_ids) - generated)
        return max(0, min(size, room - 1))

    def budgets(
        self, seqs: list[Sequence], other_tokens: int = 0, first_token: bool = False
    ) -> list[tuple[int, int]]:
        """This step's (budget, deep budget) per sequence: the most nodes of a tree a draft
        model grows, and of a model-free one (a suffix or n-gram match, which costs no draft
        pass and may go deeper). Fixed policy, or a pinned size: the caps. Adaptive: what the
        policy chooses within them.

        On a step that gives an interactive request its first token (`first_token`), that
        token would wait for the drafts of the others: with at most one other sequence
        drafting, the adaptive policy drafts nothing (the draft time saved for the new request
        is worth about what one sequence's speculation gains in a step); with more, the
        others' loss outweighs it and they draft as usual."""
        self._step = None
        self.steps += 1
        caps = [self.cap(s) for s in seqs]
        deep_caps = [self.cap(s, self.deep_tree_size) for s in seqs]
        drafting = sum(c > 0 or d > 0 for c, d in zip(caps, deep_caps, strict=True))
        if self.policy is None or not drafting:
            return list(zip(caps, deep_caps, strict=True))
        pinned = [s.tree_size is not None for s in seqs]
        if first_token and drafting <= 1:
            return [
                (cap, deep) if pin else (0, 0)
                for cap, deep, pin in zip(caps, deep_caps, pinned, strict=True)
            ]
        # A sequence whose own rate is not measured yet is priced as if its drafts were good
        # (EXPLORE_ALPHA): judged by the service-wide rate alone, a sequence that would gain
        # (code, say, where a prior fit for prose says no) might never draft; priced at its
        # cap whatever the cost, it would pay for the finding out where no draft can pay.
        # Its first draft-model tree has the draft model take in its whole context: a cost
        # spread over the tokens exploring emits (CATCH_UP_HORIZON; AdaptivePolicy.budgets).
        # So does a draft model that fell behind since its last tree (steps of plain decoding,
        # or a model-free tree's accepted tokens): on a probe step (every PROBE_EVERY), a
        # sequence that had not drafted for 64 steps made its draft model take them in first,
        # unpriced (231 ms here, about 5 plain steps).
        policy = self.policy
        model = [
            Candidate(
                cap,
                explored(policy.alpha(s.drawn_accepted, s.drawn_tested), s.drawn_tested),
                pin,
                catch_up=self._catch_up(s),
                remaining=min(s.max_tokens - len(s.output_ids), CATCH_UP_HORIZON),
            )
            for s, cap, pin in zip(seqs, caps, pinned, strict=True)
        ]
        ks = policy.budgets(model, other_tokens)
        free = [
            Candidate(
                cap
                if pin or not exploring(s.free_tested, s.free_trees)
                else min(cap, EXPLORE_DEPTH),
                explored(
                    policy.alpha(s.free_accepted, s.free_tested, True), s.free_tested, s.free_trees
                ),
                pin,
                (s.free_matched + 1) / (s.free_asked + 1),  # (1 before the first ask)
            )
            for s, cap, pin in zip(seqs, deep_caps, pinned, strict=True)
        ]
        # Each model-free tree in a pass of the others' tokens (it replaces its draft-model
        # tree); the drafter's round trip is its own where no draft-model tree asks anyway.
        tokens = other_tokens + sum(1 + k for k in ks)
        rate = policy.rate(model, ks, other_tokens)
        asking = [0.0] * len(ks) if any(ks) else [policy.cost.round_trip] * len(ks)
        deep = policy.deep_budgets(free, rate, [tokens - k for k in ks], asking)
        self._step = _StepPrice(rate, tokens, deep)
        return [
            (k, self._free_ask(s, cap) if k == 0 and not pin else d)
            for s, k, d, cap, pin in zip(seqs, ks, deep, deep_caps, pinned, strict=True)
        ]

    def _free_ask(self, seq: Sequence, cap: int) -> int:
        """The deep budget of a sequence whose draft model has none this step: its cap (the
        drafter sizes a suffix tree by its match, and a scored one is cut to what pays
        when it arrives: `_priced`), unless it waits after asks that left nothing to check."""
        return cap if self.steps >= seq.free_next else 0

    def calibrate(self, time_pass, most_tokens: int) -> dict[int, float]:
        """Times a forward pass of each token count a step of this verifier can have, up to
        CALIBRATE_MAX and `most_tokens` (`time_pass(tokens) -> seconds`), and seeds the
        adaptive policy's verify profile with them. Returns what was measured."""
        if self.policy is None or not self.enabled:
            return {}
        per_seq = 1 + max(self.tree_size, self.deep_tree_size)
        largest = min(CALIBRATE_MAX, most_tokens, self.batch_size * per_seq)
        if largest < 1:  # (a KV pool too small for a scratch sequence: the line fit alone)
            return {}
        time_pass(1)  # (a warm-up)
        measured = {  # (small counts, cheap, timed twice: their differences decide small trees)
            n: min(time_pass(n) for _ in range(2 if n < 10 else 1))
            for n in CALIBRATE_COUNTS
            if n <= largest
        }
        for _ in range(CALIBRATE_RETRIES):
            slowed = [
                n
                for n, seconds in measured.items()
                if any(seconds > SLOWED * measured[m] for m in measured if m > n)
            ]
            if not slowed:
                break
            log.info(
                "verify profile: counts slower than larger ones, timed again",
                extra={"ms": {n: round(1000 * measured[n], 2) for n in slowed}},
            )
            for n in slowed:
                measured[n] = min(measured[n], time_pass(n))
        self.policy.cost.calibrate(measured)
        return measured

    def observe_step(self, tokens: int, verify_seconds: float, prefill_tokens: int) -> None:
        """A step's forward pass took verify_seconds for `tokens` tokens. Only decode steps
        inform the cost model: the tree budget trades decode tokens, and a prompt chunk's
        tokens (long attention rows) cost more each than the nodes it would price."""
        if self.policy is not None and prefill_tokens == 0:
            self.policy.cost.observe_verify(tokens, verify_seconds)

    def priced_verify(self, tokens: int) -> float:
        """What the adaptive policy prices a pass of `tokens` tokens at (0 without one)."""
        return self.policy.cost.verify_seconds(tokens) if self.policy is not None else 0.0

    def observe_acceptance(
        self, seq: Sequence, tree: DraftTree, accepted: list[int], tested: int
    ) -> None:
        """What the target kept of a sequence's tree: the nodes of its accepted path, and
        the draft tokens it checked (those and the first rejection, if any)."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "checked",
                extra={
                    "nodes": len(tree),
                    "accepted": len(accepted),
                    "model_free": tree.model_free,
                    "expected": round(sum(tree.scores), 2) if tree.scores else None,
                },
            )
        seq.tested += tested
        self._learn(seq, tree, accepted, tested)

    def _learn(
        self, seq: Sequence, tree: DraftTree, accepted: list[int], tested: int, first: int = 0
    ) -> None:
        """What the policy learns of a tree's nodes from `first` on, the target having kept
        the path `accepted` (node indices) and checked `tested` draft tokens of it: the chances
        of scored nodes (service-wide and the sequence's), and with the whole tree, the
        acceptance rate of its kind."""
        if self.policy is not None and tree.scores:
            kept = np.zeros(len(tree), dtype=bool)
            kept[accepted] = True
            seq.scored.observe(tree.scores[first:], kept[first:])
            self.policy.scores.observe(tree.scores[first:], kept[first:])
        if first:
            return
        if tree.model_free:
            seq.free_accepted += len(accepted)
            seq.free_tested += tested
            seq.free_trees += 1
        else:
            seq.drawn_accepted += len(accepted)
            seq.drawn_tested += tested
        if self.policy is not None:
            self.policy.observe_acceptance(len(accepted), tested, free=tree.model_free)

    def _shadowed(self, seq: Sequence) -> None:
        """Scores the sequence's shadow tree, if any, against the tokens emitted since it
        came, once they decide every one of its nodes: the path they follow ends where the
        next token matches no child, or at a leaf. Its unchecked nodes then teach the policy
        as checked ones do (`_learn`): the calibration of scores by bin learns from every
        tree the drafters send, not only from those it chose to check (left alone, a bin
        priced too high is only corrected by paying for its nodes, and one priced too low
        never is). A shadow the sequence ends before deciding is dropped."""
        shadow = seq.shadow
        if shadow is None:
            return
        tree, kids, path = shadow.tree, shadow.kids, shadow.path
        for token in seq.output_ids[shadow.start + len(path) :]:  # (the tokens not walked yet)
            node = tree.child(kids, path[-1] if path else -1, token)
            if node is None:  # (decided: the target went where no node goes)
                break
            path.append(node)
        else:
            if not path or path[-1] in kids:  # (not decided yet: the next token may go deeper)
                if seq.finish_reason is not None:
                    seq.shadow = None
                return
        seq.shadow = None
        self._learn(seq, tree, path, tree.tested(len(path)), shadow.checked)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "shadowed",
                extra={
                    "nodes": len(tree) - shadow.checked,
                    "kept": sum(node >= shadow.checked for node in path),
                },
            )

    def propose(
        self, seqs: list[Sequence], other_tokens: int = 0, first_token: bool = False
    ) -> list[DraftTree]:
        """One tree per sequence (empty: plain decoding for it this step); other_tokens are
        the step's prefill tokens, which the adaptive policy counts in the cost."""
        for seq in seqs:
            self._shadowed(seq)
        budgets = self.budgets(seqs, other_tokens, first_token)
        for budget in budgets:
            metrics.TREE_BUDGET.observe(max(budget))
        if not any(map(any, budgets)) and not self.sync.has_finished:  # (tell drafters)
            return [DraftTree() for _ in seqs]
        trees: list[DraftTree | None] = [None] * len(seqs)
        if self.pool is not None:
            started = time.perf_counter()
            trees = self._ask_drafters(seqs, budgets)
            seconds = time.perf_counter() - started
            if self.policy is not None and all(t is not None for t in trees):
                self._observe_drafts(seqs, budgets, trees, seconds)
            if log.isEnabledFor(logging.DEBUG):  # (with the engine's "step": the policy's view)
                log.debug(
                    "drafted", extra={"budgets": budgets, "draft_ms": round(1000 * seconds, 1)}
                )
        answered = [t is not None for t in trees]
        for i, (seq, budget) in enumerate(zip(seqs, budgets, strict=True)):
            if trees[i] is None:  # the fallback's n-gram trees are model-free: the larger
                seq.fallback_steps += max(budget) > 0
                metrics.FALLBACK_STEPS.inc(max(budget) > 0)
                trees[i] = self._fallback(seq, max(budget))
        if self.policy is not None:
            arrived, trees = trees, self._priced(seqs, trees, budgets)
            for seq, whole, tree in zip(seqs, arrived, trees, strict=True):
                if whole.model_free and len(tree) < len(whole) and seq.shadow is None:
                    seq.shadow = Shadow(whole, len(seq.output_ids), len(tree), whole.children())
        for seq, (k, deep), tree, came in zip(seqs, budgets, trees, answered, strict=True):
            if came and k == 0 and deep > 0:  # (a model-free tree alone asked the drafter)
                self._asked_alone(seq, tree)
            seq.drafted += len(tree)
        return trees

    def _asked_alone(self, seq: Sequence, tree: DraftTree) -> None:
        """A step asked the drafter for the sequence's model-free tree alone, and kept `tree`
        of what came (empty: no match, or nothing that paid): after 1, 2, 3, ... such asks in a
        row that kept nothing, the sequence waits at least p - 1 = 1, 3, 7, ... steps
        (FREE_WAIT_MAX at most) and asks again on the next step that is a multiple of p, so
        that sequences which wait ask together, in one round trip."""
        seq.free_asked += 1
        seq.free_matched += len(tree) > 0
        seq.free_misses = 0 if len(tree) else seq.free_misses + 1
        period = min(2**seq.free_misses, FREE_WAIT_MAX + 1)
        seq.free_next = -(-(self.steps + period) // period) * period  # (rounded up to p)

    def _priced(self, seqs: list[Sequence], trees: list[DraftTree], budgets) -> list[DraftTree]:
        """Each model-free tree cut to what pays in this step: a scored one to the first
        nodes whose calibrated chances, refined by the sequence's own record (SequenceScores),
        pay for their time (AdaptivePolicy.scored_nodes, in a pass of the step's other
        tokens and the trees kept before it); an unscored one (an
        n-gram match, the fallback's too) to the deep budget the policy priced by the
        sequence's acceptance. A request that pinned its tree size keeps what it asked for."""
        step, out = self._step, []
        if step is None:  # (no sequence drafts: the step only tells of ended ones)
            return trees
        tokens = step.tokens
        for seq, tree, (k, _), priced in zip(seqs, trees, budgets, step.deep, strict=True):
            if tree.model_free and seq.tree_size is None:
                if tree.scores:
                    n = self.policy.scored_nodes(tree.scores, tokens - k, step.rate, seq.scored)
                else:
                    n = priced
                tree = tree.prefix(n)
                tokens += len(tree)
            out.append(tree)
        return out

    def _observe_drafts(self, seqs, budgets, trees: list[DraftTree], seconds: float) -> None:
        """What the drafters took this step, for the cost model. Levels are those of the
        draft model's trees: model-free ones cost no draft pass. A step where the draft model
        took in a sequence's whole context (its first draft-model tree) measures that catch-up
        (beyond the usual step); only steady steps price the levels: a drafter taking in more
        than a step's tokens (a new or moved sequence, or what a deep model-free tree had
        accepted) costs once, not per level."""
        cost = self.policy.cost
        drawn = [k for (k, _), t in zip(budgets, trees, strict=True) if not t.model_free]
        levels, drafting = max(drawn, default=0), sum(k > 0 for k in drawn)
        caught_up = 0
        for s, (k, _), t in zip(seqs, budgets, trees, strict=True):
            if k and not t.model_free:
                behind = len(s.all_ids) - s.drawn_at
                caught_up += behind if self._behind(s, behind) else 0
                s.drawn_at = len(s.all_ids)
        if caught_up:
            cost.observe_catch_up(
                caught_up, max(0.0, seconds - cost.draft_seconds(levels, drafting))
            )
        elif self.sync.largest_delta <= self.tree_size + 1:
            if not any(k for k, _ in budgets):
                cost.observe_round_trip(seconds)
            cost.observe_draft(levels, drafting, seconds)

    def _catch_up(self, seq: Sequence) -> float:
        """Seconds the sequence's draft model needs to take in what it has not seen, before
        its next tree (0 where that is no more than a steady step takes in)."""
        behind = len(seq.all_ids) - seq.drawn_at
        return self.policy.cost.catch_up_seconds(behind) if self._behind(seq, behind) else 0.0

    def _behind(self, seq: Sequence, tokens: int) -> bool:
        """Whether a draft model `tokens` behind `seq` has a catch-up to make: its first tree,
        or more than a steady step takes in (the tokens a tree of the largest size accepts,
        which the draft step's own cost covers)."""
        return seq.drawn_at == 0 or tokens > self.tree_size + 1

    def forget(self, seq: Sequence) -> None:
        """The sequence ended: tell its drafter with the next message."""
        self._shadowed(seq)
        self.sync.forget(seq, completed=seq.finish_reason is not None)
        if self.pool is not None:
            self.pool.release(seq.request_id)

    def _fallback(self, seq: Sequence, budget: int) -> DraftTree:
        if self.fallback is None or budget == 0:
            return DraftTree()
        return self.fallback.propose_one(seq.all_ids, budget)

    def _ask_drafters(
        self, seqs: list[Sequence], budgets: list[tuple[int, int]]
    ) -> list[DraftTree | None]:
        """Each sequence's tree from its drafter; None where that drafter failed, was late or
        none is usable. One message per drafter, all sent before any answer is awaited."""
        pool, sync = self.pool, self.sync
        pool.refresh()
        step = sync.next_step()
        groups = self._groups(seqs)
        for address, members in groups.items():
            client = pool.clients[address]
            if not client.is_open:
                client.open()  # a new stream: the epoch moves on, every sequence resends it all
            request = sync.request(
                client, [seqs[i] for i in members], [budgets[i] for i in members], pool.clients
            )
            client.send(request)
        trees: list[DraftTree | None] = [None] * len(seqs)
        deadline = time.monotonic() + self.timeout
        for address, members in groups.items():
            try:
                response = pool.clients[address].receive(step, deadline)
            except DraftUnavailable as e:  # a stream error closed the stream; a late one stays
                pool.breakers[address].failure()
                log.warning(
                    "drafting failed; falling back", extra={"drafter": address, "reason": str(e)}
                )
                continue
            pool.breakers[address].success()
            if response.HasField("cost") and self.policy is not None:
                cost = response.cost
                self.policy.cost.draft_prior(cost.level_seconds, cost.catch_up_seconds_per_token)
                log.info(
                    "draft model priced by its drafter",
                    extra={
                        "drafter": address,
                        "level_ms": round(1000 * cost.level_seconds, 2),
                        "catch_up_ms_per_token": round(1000 * cost.catch_up_seconds_per_token, 2),
                    },
                )
            sync.resynced(response.resync_ids)
            by_id = {t.sequence_id: t for t in response.trees}
            for i in members:
                trees[i] = self._checked(by_id.get(seqs[i].request_id), budgets[i])
        return trees

    def _groups(self, seqs: list[Sequence]) -> dict[str, list[int]]:
        """The sequences (indices) each drafter drafts for this step; a drafter that is only to
        be told of ended sequences gets a message too, while its stream lives."""
        pool, sync = self.pool, self.sync
        groups: dict[str, list[int]] = {}
        for i, seq in enumerate(seqs):
            # Greedy sequences draft from their tenant's outputs: they go where those are.
            tenant = seq.tenant if seq.params.temperature == 0 else None
            address = pool.assign(seq.request_id, tenant)
            if address is not None:
                groups.setdefault(address, []).append(i)
        for address in sync.drafters_to_tell():  # ended sequences free their drafter's caches
            client = pool.clients.get(address)
            if client is None or not client.is_open:  # that state is gone anyway
                sync.drop_finished(address)
            elif address not in groups and pool.breakers[address].allow():
                groups[address] = []
        return groups

    def _checked(self, msg, budgets: tuple[int, int]) -> DraftTree:
        tree = from_proto(msg) if msg is not None else DraftTree()
        budget, deep = budgets
        try:
            tree.validate(self.vocab_size)
            if tree.model_free and tree.dists:
                raise ValueError("a model-free tree carries draft distributions")
            if tree.scores and not tree.model_free:
                raise ValueError("node scores come with model-free trees only")
            budget = node_limit(tree, budget, deep)
            if len(tree) > budget:
                raise ValueError(f"{len(tree)} nodes exceed the budget of {budget}")
        except ValueError as e:
            log.warning("bad draft tree dropped", extra={"reason": str(e)})
            tree = DraftTree()
        return tree

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
