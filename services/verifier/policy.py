"""How many draft nodes each sequence gets per step: its tree budget.

Two budgets per sequence: one for a tree a draft model grows, one (the deep budget) for a
model-free tree (a suffix or n-gram match), which costs no draft pass. `fixed` gives every
speculating sequence `verification_tree_size` and `deep_tree_size`. `adaptive` chooses, each
step, the draft-model budgets that maximise expected emitted tokens per second of step time,
and then the deep budgets (`deep_budgets`: as deep as a node still pays for its verify time):

- Expected tokens of a sequence with budget k, treating its tree as a chain whose tokens the
  target keeps independently with probability alpha (the sequence's running acceptance rate,
  smoothed towards the service-wide rate): 1 + alpha + ... + alpha^k.
- Step time, from a cost model fitted to this verifier's own measured steps (least squares over
  a window of recent steps): verify = a + b * tokens in the forward pass; drafting, when any
  sequence drafts, = e + levels * (c + d * drafting sequences), with levels = the largest
  budget. Steps that prefill are left out of the verify fit, and steps where a drafter took in
  a whole prompt out of the draft fit: both costs come once per request, not per node.

The search tries every common cap K from 0 to the configured size; under each, sequences whose
expected gain is worth less than the time their nodes cost drop to 0. K = 0 is plain decoding,
which wins when the batch is large enough that extra tokens cost more than they return.
Requests that pinned a tree size keep it, and count in the cost. (The speculator also drafts
nothing on a step that gives an interactive request its first token while at most one other
sequence would draft; see Speculator.budgets.)
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

PRIOR_ACCEPTANCE = 0.6  # service-wide rate before anything was measured
PRIOR_WEIGHT = 4.0  # tested draft tokens the service-wide rate counts as, per sequence
REFIT_EVERY = 16  # observations between refits
PROBE_EVERY = 64  # steps: one in this many uses the largest budget, to keep measuring drafts


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
        self._since_fit = 0

    def observe_verify(self, tokens: int, seconds: float) -> None:
        self.verify.append((tokens, seconds))
        self._observed()

    def observe_draft(self, levels: int, seqs: int, seconds: float) -> None:
        if levels > 0:
            self.draft.append((levels, seqs, seconds))
            self._observed()

    def _observed(self) -> None:
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY or len(self.verify) + len(self.draft) <= REFIT_EVERY:
            self.fit()

    def fit(self) -> None:
        self._since_fit = 0
        if self.verify:
            x = np.array([[1.0, n] for n, _ in self.verify])
            y = np.array([s for _, s in self.verify])
            sizes = Counter(n for n, _ in self.verify)
            self.per_token_known = sum(count >= 2 for count in sizes.values()) >= 2
            if self.per_token_known:
                self.coef.a, self.coef.b = _nonnegative_lstsq(x, y)
            else:  # one step size seen (a stray other): what a token costs is unknown, and
                self.coef.a, self.coef.b = float(y.mean()), 0.0  # taken as 0: drafts get tried
        if self.draft:
            x = np.array([[1.0, k, k * n] for k, n, _ in self.draft])
            y = np.array([s for _, _, s in self.draft])
            self.coef.e, self.coef.c, self.coef.d = _nonnegative_lstsq(x, y)

    def step_seconds(self, tokens: int, levels: int, drafting: int) -> float:
        c = self.coef
        draft = c.e + levels * (c.c + c.d * drafting) if levels else 0.0
        return c.a + c.b * tokens + draft


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


@dataclass
class Candidate:
    """One sequence of the step, as the policy sees it."""

    cap: int  # most nodes it may get (room left, request limit); 0: not speculating
    alpha: float  # estimated per-token acceptance
    pinned: bool = False  # the request fixed its tree size: it gets cap


class AdaptivePolicy:
    def __init__(self, max_budget: int, cost: CostModel | None = None):
        self.max_budget = max_budget
        self.cost = cost or CostModel()
        self.service_alpha = PRIOR_ACCEPTANCE  # of draft-model trees
        self.service_free_alpha = PRIOR_ACCEPTANCE  # of model-free trees (suffix, n-gram)
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

    def deep_budgets(self, candidates: list[Candidate], rate: float) -> list[int]:
        """Budgets of model-free trees, which cost no draft pass, only their verification: the
        deepest k whose last node still pays, alpha^k >= b x rate (the tokens the node is
        expected to add against those the step's rate loses in the node's verify time b)."""
        lost = self.cost.coef.b * rate
        if not self.cost.per_token_known:  # b = 0 only stands for "not measured yet"
            return [c.cap if c.pinned else min(c.cap, self.max_budget) for c in candidates]
        budgets = []
        for c in candidates:
            if c.pinned or c.alpha >= 1.0 or lost <= 0.0:
                budgets.append(c.cap)
            elif lost >= 1.0 or c.alpha <= 0.0:
                budgets.append(0)
            else:
                budgets.append(min(c.cap, int(math.log(lost) / math.log(c.alpha))))
        return budgets

    def budgets(self, candidates: list[Candidate], other_tokens: int) -> list[int]:
        """Budgets that maximise expected tokens per second; other_tokens are tokens in the
        forward pass that emit nothing (prefill chunks). One step in PROBE_EVERY gives every
        sequence its cap instead, so that the draft cost is measured again even while the
        model says plain decoding is better (a drafter that got faster is noticed)."""
        self.steps += 1
        if self.steps % PROBE_EVERY == 0:
            return [c.cap if c.pinned else min(c.cap, self.max_budget) for c in candidates]
        best, best_rate = [0] * len(candidates), -1.0
        top = min(self.max_budget, max((c.cap for c in candidates), default=0))
        for cap in range(top + 1):
            ks = [c.cap if c.pinned else min(cap, c.cap) for c in candidates]
            rate = self.rate(candidates, ks, other_tokens)
            # Drop sequences whose nodes cost more time than their expected gain is worth.
            per_token = self.cost.coef.b
            for i, c in enumerate(candidates):
                if ks[i] and not c.pinned:
                    gain = expected_tokens(c.alpha, ks[i]) - 1.0
                    if gain < per_token * ks[i] * rate:
                        ks[i] = 0
            rate = self.rate(candidates, ks, other_tokens)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = ks, rate
        return best

    def rate(self, candidates: list[Candidate], ks: list[int], other_tokens: int) -> float:
        """Expected emitted tokens per second of a step with budgets ks."""
        tokens = other_tokens + sum(1 + k for k in ks)
        drafting = sum(k > 0 for k in ks)
        seconds = self.cost.step_seconds(tokens, max(ks, default=0), drafting)
        emitted = sum(expected_tokens(c.alpha, k) for c, k in zip(candidates, ks, strict=True))
        return emitted / max(seconds, 1e-6)
