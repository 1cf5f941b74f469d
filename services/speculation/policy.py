"""How many draft nodes each sequence gets per step: its tree budget.

Two budgets per sequence: one for a tree a draft model grows, one (the deep budget) for a
model-free tree (a suffix or n-gram match), which costs no draft pass. `fixed` gives every
speculating sequence `verification_tree_size` and `deep_tree_size`. `adaptive` chooses, each
step, the draft-model budgets that maximise expected emitted tokens per second of step time,
and then the deep budgets (`deep_budgets`: as deep as a node still pays for its verify time):

- Expected tokens of a sequence with budget k, treating its tree as a chain whose tokens the
  target keeps independently with probability alpha (the sequence's running acceptance rate,
  smoothed towards the service-wide rate): 1 + alpha + ... + alpha^k.
- Step time, from a cost model of this verifier's own measured steps. Verify time by the
  tokens in the forward pass is a measured profile: each token count timed at start
  (`calibrate`, on the model itself; counts between two measured ones interpolated, past the
  largest the last two's slope), times a scale: the median of the last SCALE_STEPS steps'
  times over the profile's (other processes on the same cores, a longer context). A
  profile, not a line, because a quantised kernel prices rows in blocks: the int4 default
  target took 58 ms for 1 token, 97 ms for 4 and 178 ms for 5 on this CPU; a scale, not an
  average per count, because steps of one count (plain decoding) would move that count alone
  (its 56 ms became 94 ms over one 128-token stream through the cluster, with the drafter
  and gateway on the same two cores, and a tree of 2 looked free). Drafting, when any
  sequence drafts, = e + levels * (c + d * drafting sequences), with levels = the largest
  budget (least squares; before any draft step is timed, c is the drafter's own timing of
  its draft model, `draft_prior`, and 0 without one). Steps that prefill are left out of the
  verify fit, and steps where a drafter took in a whole prompt out of the draft fit: both
  costs come once per request, not per node.
- The draft model's catch-up: before a sequence's first draft-model tree, the draft model
  takes in its whole context (seconds per token measured on such steps; before the first,
  the drafter's timing, or without one DRAFT_SHARE of the target's). That cost comes once,
  so it is charged to the steps in proportion to the share of the tokens it buys that they
  are expected to emit: the candidate's `remaining`, which the speculator caps at what
  exploring the draft model emits (speculator.CATCH_UP_HORIZON), since the catch-up is only
  known to buy that. Where taking in a context costs more than speculation can win back in
  those tokens, the draft model is not started (13 Spec-Bench streams at once ran at
  0.80-0.85x plain while it was not priced, or spread over whole answers).

The search tries every common cap K from 0 to the configured size; under each, sequences whose
expected gain is worth less than the time their nodes add to the step drop to 0. K = 0 is
plain decoding, which wins when the batch is large enough that extra tokens cost more than
they return. Speculation wins only by MARGIN (5%) of the plain rate. A model-free tree gets
the depth k whose expected extra tokens most exceed what the step's rate loses in the time
those k nodes add, if that is at least MARGIN tokens; a scored one (the suffix proposer's,
each node with its chance that the target keeps the path to it) is cut on arrival to the
first n nodes whose chances, calibrated by what the target kept of nodes of such scores
(`ScoreCalibration`) and refined, bin by bin, by how the sequence's own scored nodes came
true (`SequenceScores`), most exceed that time (`scored_nodes`). Requests that pinned a tree
size keep it, and count in the cost. A sequence whose own rate is not measured yet, and
every sequence on a probe step, is priced with an acceptance of at least EXPLORE_ALPHA: it
drafts where good drafts would pay, at the size they would pay at, and not where even those
would not. (The speculator also drafts nothing on a step that gives an interactive request
its first token while at most one other sequence would draft; see Speculator.budgets.)
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import numpy as np

PRIOR_ACCEPTANCE = 0.6  # service-wide rate before anything was measured
PRIOR_WEIGHT = 4.0  # tested draft tokens the service-wide rate counts as, per sequence
REFIT_EVERY = 16  # observations between refits
PROBE_EVERY = 64  # steps: one in this many prices drafts optimistically, to measure them again
EXPLORE_ALPHA = 0.8  # the acceptance a sequence not yet measured (or probed) is priced at
VERIFY_EWMA = 0.2  # weight of a step in the round trip and the catch-up's moving averages
# The profile's scale is the median of this many steps' times over the profile's, not a moving
# average: one step that other work stalled (219 ms against a 30 ms profile, as a request ended
# here) moved an average of weight 0.2 to 2.3x, every verify time looked 2.3 times dearer while
# the draft model's did not, and the next request, prose, drafted chains of 3 for 12 steps at
# 110 ms a step (33 tokens where plain steps took 27 ms a token): 9% of that request.
SCALE_STEPS = 16
OUTLIER = 3.0  # a draft step over this many times the usual time per level is left out
# Before a draft model has taken in any context, what it costs a token is priced at this share
# of the target's per-token time in its largest calibrated pass (the default draft has a third
# of the target's parameters); the first catch-up measured replaces it.
DRAFT_SHARE = 1 / 3
# Speculation must be expected to beat plain decoding by this share of its rate (a model-free
# tree: to gain this many tokens net of its time). What the cost model does not see (a draft
# model catching up after model-free steps, a noisy profile entry) costs a few percent:
# without it the int4 pair here chose a chain of 1 at an expected 1.02x and ran at 0.9x.
MARGIN = 0.05
# Calibration of model-free node scores (ScoreCalibration): bins of the score, each bin's prior
# (the share of such nodes the target kept) and how many nodes it counts as, and at most
# (older nodes fade). The priors are the suffix proposer's on the public workloads, replayed
# against the default target's greedy outputs (`python -m benchmarks.acceptance --per-category
# 3 --proposers suffix`: 14,927 nodes, 51-6,021 a bin): scores overrate their nodes 1.1-2.5x,
# the low bins the most. Taken at their word instead (the bins' midpoints), a fresh verifier
# checked a code request's 18-node tree of a 10-token match, its scores summing to 9.6 tokens:
# one pass of 19 tokens, 167 ms against 36 for one, and the target kept none (a Xeon, int4).
SCORE_BINS = 10
SCORE_PRIOR = (0.023, 0.059, 0.104, 0.184, 0.263, 0.328, 0.476, 0.648, 0.704, 0.863)
SCORE_PRIOR_NODES = 8.0
SCORE_WINDOW_NODES = 2000.0
# A sequence's own record refines those chances bin by bin (SequenceScores): its checked nodes
# of a bin, each tree's weight fading by SEQUENCE_SCORE_DECAY, with the service-wide chance
# counted as SEQUENCE_SCORE_PRIOR nodes.
SEQUENCE_SCORE_DECAY = 0.95
SEQUENCE_SCORE_PRIOR = 2.0


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits with k chained drafts each kept with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class Coefficients:
    a: float = 0.0  # verify: seconds per step
    b: float = 0.0  # verify: seconds per token
    c: float = 0.0  # draft: seconds per level
    d: float = 0.0  # draft: seconds per level per drafting sequence
    e: float = 0.0  # draft: seconds per drafting step (round trip, taking in accepted tokens)


class CostModel:
    """Step time as a function of tokens, levels and batch; refitted as steps are measured."""

    def __init__(self, window: int = 256, draft_window: int = 32):
        self.verify: deque[tuple[int, float]] = deque(maxlen=window)
        self.draft: deque[tuple[int, int, float]] = deque(maxlen=draft_window)
        self.coef = Coefficients()
        self.per_token_known = False  # b was fitted from steps of two sizes or more
        self.profile: dict[int, float] = {}  # verify seconds by tokens, timed at start
        self.scale = 1.0  # passes now against the profile (other load, a longer context)
        self._ratios: deque[float] = deque(maxlen=SCALE_STEPS)  # (what the scale is made of)
        self.round_trip = 0.0  # seconds a step waits for model-free trees alone (moving average)
        self.catch_up: float | None = None  # draft model seconds per context token (average)
        self.catch_up_prior = 0.0  # ... before any was measured (from the profile)
        self._points: tuple[np.ndarray, np.ndarray] | None = None  # the profile, sorted
        self._at: dict[int, float] = {}  # _shape of one count, kept: the search asks often
        self._since_fit = 0

    def calibrate(self, seconds_by_tokens: dict[int, float]) -> None:
        """Verify times measured at start, by the tokens of the pass: the profile's shape."""
        self.profile.update(seconds_by_tokens)
        largest = max(self.profile)
        self.catch_up_prior = DRAFT_SHARE * self.profile[largest] / largest
        self._points = None
        self._at.clear()
        for tokens, seconds in seconds_by_tokens.items():
            self.verify.append((tokens, seconds))
        self.fit()

    def draft_prior(self, level_seconds: float, catch_up_per_token: float) -> None:
        """A drafter's own timing of its draft model (as it started): what a level costs until
        steady draft steps are timed here, and a token of catch-up until one is."""
        self.catch_up_prior = catch_up_per_token
        if not self.draft:
            self.coef.c = level_seconds

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify.append((tokens, seconds))
        if self.profile:
            self._ratios.append(seconds / float(self._shape(tokens)))
            self.scale = statistics.median(self._ratios)
        self._observed(self.verify)

    def verify_seconds(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """A forward pass's time for `tokens` tokens (an int, or an array of counts)."""
        if self.profile and isinstance(tokens, int):  # (the budget search's many lookups)
            if tokens not in self._at:
                self._at[tokens] = float(self._shape(tokens))
            return self.scale * self._at[tokens]
        n = np.asarray(tokens, dtype=np.float64)
        if self.profile:
            out = self.scale * self._shape(n)
        else:
            out = self.coef.a + self.coef.b * n
        return out if n.ndim else float(out)

    def _shape(self, n) -> np.ndarray:
        """The profile at `n` tokens: interpolated between measured counts, and past the
        largest extended by the slope of its last two."""
        if self._points is None:
            counts = sorted(self.profile)
            self._points = (
                np.array(counts, dtype=np.float64),
                _nondecreasing([self.profile[k] for k in counts]),
            )
        counts, times = self._points
        n = np.asarray(n, dtype=np.float64)
        slope = (times[-1] - times[-2]) / (counts[-1] - counts[-2]) if len(counts) > 1 else 0.0
        past = times[-1] + max(slope, 0.0) * (n - counts[-1])
        return np.where(n > counts[-1], past, np.interp(n, counts, times))

    def observe_round_trip(self, seconds: float) -> None:
        """A step that asked the drafters for model-free trees alone waited `seconds`."""
        self.round_trip += VERIFY_EWMA * (seconds - self.round_trip)

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft model took `seconds` (beyond its usual step) to take in `tokens` tokens."""
        if tokens > 0:
            per_token = seconds / tokens
            last = self.catch_up
            self.catch_up = per_token if last is None else last + VERIFY_EWMA * (per_token - last)

    def catch_up_seconds(self, tokens: int) -> float:
        """What a draft model takes to take in `tokens` tokens of a sequence's context."""
        return tokens * (self.catch_up_prior if self.catch_up is None else self.catch_up)

    def draft_seconds(self, levels: int, drafting: int) -> float:
        c = self.coef
        return c.e + levels * (c.c + c.d * drafting) if levels else 0.0

    def observe_draft(self, levels: int, seqs: int, seconds: float) -> None:
        if levels > 0:
            self.draft.append((levels, seqs, seconds))
            self._observed(self.draft)

    def _observed(self, window: deque) -> None:
        """Refits every REFIT_EVERY observations, and at each one that lands in a short window
        (the first drafts price the next: a calibrated verify window is long from the start).
        A step adds to the verify window alone where no draft model drafts: its refit came
        every step while the draft window stayed empty, 0.1 ms of the speculator's 0.24 a
        step for one sequence here."""
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or len(window) <= REFIT_EVERY:
            self.fit()

    def fit(self) -> None:
        self._since_fit = 0
        if self.verify:
            x = np.array([[1.0, n] for n, _ in self.verify])
            y = np.array([s for _, s in self.verify])
            sizes = Counter(n for n, _ in self.verify)
            repeated = sum(count >= 2 for count in sizes.values())  # (a stray step aside)
            self.per_token_known = repeated >= 2 or len(self.profile) >= 2  # (measured once)
            if self.per_token_known:
                self.coef.a, self.coef.b = _nonnegative_lstsq(x, y)
            else:  # one step size seen (a stray other): what a token costs is unknown, and
                self.coef.a, self.coef.b = float(y.mean()), 0.0  # taken as 0: drafts get tried
        if self.draft:
            x = np.array([[1.0, k, k * n] for k, n, _ in self.draft])
            y = np.array([s for _, _, s in self.draft])
            # A drafter that took in more than a step's tokens (a draft model catching up with
            # a prompt, say) takes many times a step: a step over OUTLIER times the median
            # time per level (times its levels) is left out.
            usual = y <= OUTLIER * np.median(y / x[:, 1]) * x[:, 1]
            self.coef.e, self.coef.c, self.coef.d = _nonnegative_lstsq(x[usual], y[usual])

    def step_seconds(self, tokens: int, levels: int, drafting: int) -> float:
        return self.verify_seconds(tokens) + self.draft_seconds(levels, drafting)

    @property
    def known(self) -> bool:
        """Whether what a token adds to a pass is measured (a profile, or steps of two sizes)."""
        return bool(self.profile) or self.per_token_known


def _nondecreasing(times: list[float]) -> np.ndarray:
    """The non-decreasing sequence closest to `times` (least squares: adjacent violators
    pooled into their mean). A pass of more tokens never costs less; a noisy timing (the
    profile had 6 tokens at 164 ms and 7 at 131 here) would otherwise make one tree size look
    free and the next dear."""
    pools: list[list[float]] = []  # [sum, count] each
    for t in times:
        pools.append([t, 1])
        while len(pools) > 1 and pools[-2][0] * pools[-1][1] > pools[-1][0] * pools[-2][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    return np.concatenate([np.full(int(count), total / count) for total, count in pools])


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares of y on the columns of x with every coefficient >= 0 (time never shrinks
    as work grows): while one comes out negative, the most negative column is dropped and the
    rest refitted. Columns the data cannot tell apart get the minimum-norm split."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        fit, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (fit >= 0).all():
            coef[active] = fit
            break
        del active[int(np.argmin(fit))]
    return [float(v) for v in coef]


def score_bins(scores) -> np.ndarray:
    """Each node score's bin of SCORE_BINS (ScoreCalibration's and SequenceScores')."""
    b = (np.asarray(scores, dtype=np.float64) * SCORE_BINS).astype(np.int64)
    return np.clip(b, 0, SCORE_BINS - 1)


def count_by_bin(kept_counts: np.ndarray, checked_counts: np.ndarray, scores, kept) -> None:
    """Adds checked nodes (their scores, and whether the target kept each one's path) to
    per-bin counts, in place."""
    b = score_bins(scores)
    np.add.at(checked_counts, b, 1.0)
    np.add.at(kept_counts, b, np.asarray(kept, dtype=np.float64))


class ScoreCalibration:
    """How often the target keeps the path to a model-free node, by the score its proposer
    gave the node (histogram binning, service-wide): per bin of the score, the share of the
    checked nodes that were kept, starting from SCORE_PRIOR (what the target kept of such
    nodes on the public workloads) counted as SCORE_PRIOR_NODES nodes. A suffix tree's scores
    rank its nodes well (a long match scores its copy high, a 1-token match its guesses low)
    while their level is off by kinds of text; the bins read the level off what the target
    did."""

    def __init__(self):
        self.kept = SCORE_PRIOR_NODES * np.array(SCORE_PRIOR)
        self.checked = np.full(SCORE_BINS, SCORE_PRIOR_NODES)

    def chances(self, scores, record: SequenceScores | None = None) -> np.ndarray:
        """The chance that the target keeps each node's path, by its score (refined by a
        sequence's own `record`)."""
        b = score_bins(scores)
        service = self.kept[b] / self.checked[b]
        return service if record is None else record.refine(b, service)

    def observe(self, scores, kept) -> None:
        """Checked nodes' scores, and whether the target kept each one's path."""
        count_by_bin(self.kept, self.checked, scores, kept)
        full = self.checked > SCORE_WINDOW_NODES
        self.kept[full] /= 2
        self.checked[full] /= 2


@dataclass
class SequenceScores:
    """How one sequence's scored nodes came true, by the same bins as ScoreCalibration: the
    bins mix kinds of text, and a sequence is mostly one kind. Without it, the benchmark
    prompts' prose stream checked 20-21 suffix trees of 39-40 nodes and kept 5-6 tokens, the
    bins pricing its short matches by what the code edit's copies had kept. Kept by bin, not
    as one factor over all of them: as one factor, an edit's first tree (a short match on a
    rewritten line, none of its nodes kept) scaled every later chance to a quarter, so a
    64-node copy whose nodes scored 0.9 and more was cut to nothing, and with nothing checked
    the record never moved again; nodes of a long match fall in bins that short ones do not."""

    kept: np.ndarray = field(default_factory=lambda: np.zeros(SCORE_BINS))
    checked: np.ndarray = field(default_factory=lambda: np.zeros(SCORE_BINS))

    def observe(self, scores, kept) -> None:
        """A checked tree's node scores, and whether the target kept each one's path."""
        self.kept *= SEQUENCE_SCORE_DECAY
        self.checked *= SEQUENCE_SCORE_DECAY
        count_by_bin(self.kept, self.checked, scores, kept)

    def refine(self, bins: np.ndarray, service: np.ndarray) -> np.ndarray:
        """The chances of nodes in `bins`, from the service-wide ones (`service`) and what
        this sequence's nodes of those bins did."""
        prior = SEQUENCE_SCORE_PRIOR
        return (self.kept[bins] + prior * service) / (self.checked[bins] + prior)


@dataclass
class Candidate:
    """One sequence of the step, as the policy sees it."""

    cap: int  # most nodes it may get (room left, request limit); 0: not speculating
    alpha: float  # estimated per-token acceptance
    pinned: bool = False  # the request fixed its tree size: it gets cap
    hit: float = 1.0  # model-free: the share of asks that found a match (a tree at all)
    catch_up: float = 0.0  # seconds its draft model needs to take in its context first
    remaining: int = 1 << 30  # tokens the catch-up is charged over (it emits no more)

    def catch_up_share(self, k: int) -> float:
        """The part of its catch-up a step with budget k is charged: the share of the
        `remaining` tokens that step is expected to emit."""
        if not (k and self.catch_up):
            return 0.0
        return self.catch_up * min(1.0, expected_tokens(self.alpha, k) / max(self.remaining, 1))


class AdaptivePolicy:
    def __init__(self, max_budget: int, cost: CostModel | None = None):
        self.max_budget = max_budget
        self.cost = cost or CostModel()
        self.service_alpha = PRIOR_ACCEPTANCE  # of draft-model trees
        self.service_free_alpha = PRIOR_ACCEPTANCE  # of model-free trees (suffix, n-gram)
        self.scores = ScoreCalibration()  # of scored model-free trees' nodes
        self.steps = 0

    def alpha(self, accepted: int, tested: int, free: bool = False) -> float:
        """A sequence's acceptance rate, smoothed towards the service-wide one (of its trees'
        kind: drawn by the draft model, or model-free)."""
        prior = self.service_free_alpha if free else self.service_alpha
        return (accepted + PRIOR_WEIGHT * prior) / (tested + PRIOR_WEIGHT)

    def observe_acceptance(self, accepted: int, tested: int, free: bool = False) -> None:
        """One sequence's step: `tested` draft tokens checked, `accepted` kept."""
        if tested:
            rate = accepted / tested
            if free:
                self.service_free_alpha += 0.02 * (rate - self.service_free_alpha)
            else:
                self.service_alpha += 0.02 * (rate - self.service_alpha)

    def deep_budgets(
        self,
        candidates: list[Candidate],
        rate: float,
        tokens: list[int] | None = None,
        asking: list[float] | None = None,
    ) -> list[int]:
        """Budgets of model-free trees, which cost no draft pass, only their verification: per
        sequence the depth k whose expected extra tokens (alpha + ... + alpha^k) most exceed
        what the step's `rate` loses in the time k nodes add to the pass (of `tokens[i]`
        tokens without them; with a linear cost, the deepest k with alpha^k >= b x rate). An
        ask that finds no match returns no tree and adds no node, so that net gain counts
        `hit` times (hit, the share of asks that found a match), against `asking[i]` every
        time (the drafter's round trip, where only this tree would ask it); the tree is asked
        for if what is left is at least MARGIN tokens. On a probe step the candidates are
        priced at EXPLORE_ALPHA or better, and as if every ask matched."""
        if not self.cost.known:  # b = 0 only stands for "not measured yet"
            return [c.cap if c.pinned else min(c.cap, self.max_budget) for c in candidates]
        budgets = []
        for i, c in enumerate(candidates):
            alpha = max(c.alpha, EXPLORE_ALPHA) if self.probing else c.alpha
            hit = 1.0 if self.probing else c.hit
            base = tokens[i] if tokens else 1
            if c.pinned or c.cap == 0:
                budgets.append(c.cap)
                continue
            ks = np.arange(c.cap + 1)
            if alpha >= 1.0:
                gain = ks.astype(np.float64)
            else:
                gain = alpha * (1.0 - alpha**ks) / (1.0 - alpha)  # alpha + ... + alpha^k
            added = self.cost.verify_seconds(base + ks) - self.cost.verify_seconds(base)
            net = gain - rate * added  # tokens a match gains, net of the time its nodes take
            k = int(np.flatnonzero(net >= net.max() - 1e-12)[-1])
            ask = rate * asking[i] if asking else 0.0
            budgets.append(k if hit * net[k] - ask >= MARGIN else 0)
        return budgets

    def scored_nodes(
        self,
        scores: list[float],
        tokens: int,
        rate: float,
        record: SequenceScores | None = None,
    ) -> int:
        """How many of a scored model-free tree's first nodes to check in a pass of `tokens`
        other tokens: the n whose calibrated chances (the tokens they are expected to add;
        refined by the sequence's `record`) most exceed what the step's `rate` loses in the
        time n nodes add, or 0 if that is less than MARGIN tokens. All of them while a
        token's cost is not measured."""
        if not scores or not self.cost.known:
            return len(scores)
        gain = np.concatenate(([0.0], np.cumsum(self.scores.chances(scores, record))))
        counts = tokens + np.arange(len(scores) + 1)
        net = gain - rate * (self.cost.verify_seconds(counts) - self.cost.verify_seconds(tokens))
        n = int(np.argmax(net))
        return n if net[n] >= MARGIN else 0

    def budgets(self, candidates: list[Candidate], other_tokens: int) -> list[int]:
        """Budgets that maximise expected tokens per second; other_tokens are tokens in the
        forward pass that emit nothing (prefill chunks). One step in PROBE_EVERY prices every
        sequence at EXPLORE_ALPHA or better, so that drafts are measured again even while the
        model says plain decoding is better (a drafter that got faster is noticed), as long
        as good drafts would pay."""
        self.steps += 1
        if self.probing:
            candidates = [replace(c, alpha=max(c.alpha, EXPLORE_ALPHA)) for c in candidates]
        best, best_rate = [0] * len(candidates), -1.0
        top = min(self.max_budget, max((c.cap for c in candidates), default=0))
        for cap in range(top + 1):
            ks = [c.cap if c.pinned else min(cap, c.cap) for c in candidates]
            rate = self.rate(candidates, ks, other_tokens)
            # Drop sequences whose nodes cost more time than their expected gain is worth.
            tokens = other_tokens + sum(1 + k for k in ks)
            for i, c in enumerate(candidates):
                if ks[i] and not c.pinned:
                    gain = expected_tokens(c.alpha, ks[i]) - 1.0
                    added = self.cost.verify_seconds(tokens) - self.cost.verify_seconds(
                        tokens - ks[i]
                    )
                    added += c.catch_up_share(ks[i])
                    if gain < added * rate:
                        tokens -= ks[i]
                        ks[i] = 0
            rate = self.rate(candidates, ks, other_tokens)
            margin = MARGIN if any(ks) and not any(best) else 1e-9
            if rate > best_rate * (1 + margin):
                best, best_rate = ks, rate
        return best

    @property
    def probing(self) -> bool:
        """Whether this step (the last `budgets` counted) is a probe step."""
        return self.steps % PROBE_EVERY == 0

    def rate(self, candidates: list[Candidate], ks: list[int], other_tokens: int) -> float:
        """Expected emitted tokens per second of a step with budgets ks, less the time of its
        prompt chunks (other_tokens): every choice of budgets pays that alike, and left in, it
        would make the step's plain rate look so low that any draft beat it (a 512-token chunk
        took 10 s here, and twelve streams' draft models caught up on such steps)."""
        tokens = other_tokens + sum(1 + k for k in ks)
        drafting = sum(k > 0 for k in ks)
        seconds = self.cost.step_seconds(tokens, max(ks, default=0), drafting)
        if other_tokens:
            plain = len(ks)
            seconds -= self.cost.verify_seconds(other_tokens + plain) - self.cost.verify_seconds(
                plain
            )
        seconds += sum(c.catch_up_share(k) for c, k in zip(candidates, ks, strict=True))
        emitted = sum(expected_tokens(c.alpha, k) for c, k in zip(candidates, ks, strict=True))
        return emitted / max(seconds, 1e-6)
