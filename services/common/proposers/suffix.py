"""The `suffix` proposer: suffix matching over the sequence's own history and over its
tenant's earlier outputs, after SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975).

Each step finds the longest suffix of the history (up to `max_match` tokens) that occurred
before, in two places: the request's own prompt and output (`SuffixIndex` per sequence), and
the recent completed outputs of the same tenant (`SharedOutputs`; each kept after the last
`max_match` tokens of its prompt, so that a request with the same ending matches from its
first token). What followed the
occurrences of that suffix becomes a tree, grown best-first by frequency: a child's
probability is the share of its parent's occurrences that continue with its token, a node's
score the product along its path. The tree's total score is its expected number of accepted
tokens under those frequencies; of the two places, the tree with the higher score is
proposed. Depth follows the match: `depth_factor` x the match length, at most `max_depth`, so a
long copy drafts deep and a short, uncertain match drafts little.

An index keeps, for each short key (the last 1, 3 and 8 tokens at a position), where it ends;
a lookup extends the latest `max_candidates` of them backwards, so a step costs at most
max_candidates x max_match comparisons and budget x max_candidates to grow, however long or
repetitive the text. The shared outputs are bounded in tokens per tenant and in tenants (the
oldest tokens and the least recently used tenant go first).

Sampling requests match their own history only, so that a seeded request's output (which
depends on its trees) does not depend on other requests.

Scope: by default a tenant's outputs shape only that tenant's drafts. Shared across tenants,
how fast one tenant's request runs would tell what other tenants generated (a timing side
channel), so `suffix_scope: global` is for deployments with one trust domain.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque

from ..settings import DrafterSettings
from ..tree import DraftTree
from .base import DraftJob, Proposer

SEPARATOR = -1  # between documents of a shared index: no match or continuation crosses it
KEYS = (8, 3, 1)  # key lengths indexed, longest first: the longest key seen gives candidates


class SuffixIndex:
    """A token stream and, per key, the positions where it ends (absolute positions, oldest
    first). With `max_tokens`, the oldest tokens are evicted with their entries."""

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        self.tokens: list[int] = []  # tokens[i] is at absolute position base + i
        self.base = 0
        self.first = 0  # oldest position still indexed (older ones kept only as key context)
        self.ends: dict[tuple[int, ...], deque[int]] = {}

    @property
    def end(self) -> int:
        """Absolute position after the last token."""
        return self.base + len(self.tokens)

    def __len__(self) -> int:
        """Tokens indexed (what the memory bound counts)."""
        return self.end - self.first

    def at(self, pos: int) -> int:
        return self.tokens[pos - self.base]

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            pos = self.end - 1
            for k in KEYS:
                key = self._key(pos, k)
                if key is not None:
                    self.ends.setdefault(key, deque()).append(pos)
        if self.max_tokens is not None:
            while len(self) > self.max_tokens:
                self._evict()

    def add_document(self, tokens: list[int]) -> None:
        self.extend([*tokens, SEPARATOR])

    def _key(self, pos: int, k: int) -> tuple[int, ...] | None:
        """The k tokens ending at pos, or None where they leave the stream or cross a
        document's end."""
        start = pos - k + 1
        if start < self.base:
            return None
        key = tuple(self.tokens[start - self.base : pos - self.base + 1])
        return None if SEPARATOR in key else key

    def _evict(self) -> None:
        pos = self.first
        for k in KEYS:
            key = self._key(pos, k)
            if key is None:
                continue
            ends = self.ends[key]
            ends.popleft()  # entries are appended and evicted in position order
            if not ends:
                del self.ends[key]
        self.first += 1
        # Tokens before first are kept while a key ending at an indexed position needs them.
        slack = self.first - (KEYS[0] - 1) - self.base
        if slack > max(1024, len(self.tokens) // 2):
            del self.tokens[:slack]
            self.base += slack

    def occurrences(
        self, context: list[int], max_match: int, max_candidates: int
    ) -> tuple[int, list[int]]:
        """The longest suffix of `context` (up to max_match tokens) that ends somewhere in the
        stream with at least one token after it, and the positions where it ends (latest
        first, at most max_candidates looked at)."""
        for k in KEYS:
            if len(context) >= k:
                ends = self.ends.get(tuple(context[-k:]))
                if ends and ends[0] < self.end - 1:  # not only the stream's own end
                    break
        else:
            return 0, []
        best, found = 0, []
        for pos in itertools.islice(reversed(ends), max_candidates):
            if pos + 1 >= self.end or self.at(pos + 1) == SEPARATOR:
                continue  # nothing followed it (yet)
            m = k
            limit = min(max_match, len(context), pos - self.base + 1)
            while m < limit and self.at(pos - m) == context[-m - 1]:
                m += 1
            if m > best:
                best, found = m, [pos]
            elif m == best:
                found.append(pos)
        return best, found

    def grow(
        self, ends: list[int], depth: int, budget: int, min_token_prob: float
    ) -> tuple[DraftTree, float]:
        """The tree of what followed `ends`, best-first by frequency, and its expected accepted
        tokens (the sum of its nodes' path probabilities)."""
        tree, score = DraftTree(model_free=True), 0.0
        order = itertools.count()
        heap: list[tuple[float, int, int, int, int, list[int]]] = []

        def push_children(node: int, offset: int, prob: float, occ: list[int]) -> None:
            """Children of node (at depth `offset`): the tokens `offset` after each end."""
            if offset >= depth:
                return
            by_token: dict[int, list[int]] = {}
            for pos in occ:
                at = pos + 1 + offset
                if at < self.end and (token := self.at(at)) != SEPARATOR:
                    by_token.setdefault(token, []).append(pos)
            for token, continuing in by_token.items():
                share = len(continuing) / len(occ)
                if share >= min_token_prob:
                    entry = (-prob * share, next(order), node, token, offset, continuing)
                    heapq.heappush(heap, entry)

        push_children(-1, 0, 1.0, ends)
        while heap and len(tree) < budget:
            neg, _, parent, token, offset, occ = heapq.heappop(heap)
            node = tree.add(token, parent)
            score -= neg
            push_children(node, offset + 1, -neg, occ)
        return tree, score


class SharedOutputs:
    """Completed outputs, one bounded index per tenant (or one for all, scope "global")."""

    def __init__(self, tokens_per_tenant: int, tenants: int, scope: str = "tenant"):
        self.tokens_per_tenant, self.tenants, self.scope = tokens_per_tenant, tenants, scope
        self.indices: OrderedDict[str, SuffixIndex] = OrderedDict()  # least recent first

    def _name(self, tenant: str) -> str:
        return "" if self.scope == "global" else tenant

    def add(self, tenant: str, output: list[int]) -> None:
        if not output or self.tokens_per_tenant == 0:
            return
        name = self._name(tenant)
        index = self.indices.pop(name, None) or SuffixIndex(self.tokens_per_tenant)
        self.indices[name] = index
        index.add_document(output)
        while len(self.indices) > self.tenants:
            self.indices.popitem(last=False)

    def get(self, tenant: str) -> SuffixIndex | None:
        name = self._name(tenant)
        index = self.indices.get(name)
        if index is not None:
            self.indices.move_to_end(name)
        return index

    def tokens(self) -> int:
        return sum(len(i) for i in self.indices.values())


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(
        self,
        shared: SharedOutputs | None = None,
        max_depth: int = 64,
        max_match: int = 32,
        depth_factor: float = 2.0,
        min_match: int = 2,
        min_token_prob: float = 0.1,
        max_candidates: int = 64,
    ):
        self.shared = shared
        self.max_depth, self.max_match, self.depth_factor = max_depth, max_match, depth_factor
        self.min_match, self.min_token_prob = min_match, min_token_prob
        self.max_candidates = max_candidates
        self.requests: dict[str, SuffixIndex] = {}

    @classmethod
    def from_settings(cls, settings: DrafterSettings) -> SuffixProposer:
        shared = None
        if settings.suffix_scope != "none":
            shared = SharedOutputs(
                settings.suffix_tenant_tokens, settings.suffix_tenants, settings.suffix_scope
            )
        return cls(
            shared,
            max_depth=settings.suffix_max_depth,
            max_match=settings.suffix_max_match,
            depth_factor=settings.suffix_depth_factor,
            min_match=settings.suffix_min_match,
            min_token_prob=settings.suffix_min_token_prob,
        )

    def propose(self, jobs: list[DraftJob]) -> list[DraftTree]:
        return [self.propose_one(job)[0] for job in jobs]

    def propose_one(self, job: DraftJob) -> tuple[DraftTree, float]:
        """The better of the trees from the request's own history and its tenant's outputs,
        and its expected accepted tokens."""
        best = DraftTree(model_free=True), 0.0
        budget = job.free_budget
        if budget <= 0 or not job.tokens:
            return best
        places = [self._own(job)]
        # Sampling requests draft from their own history only: a seeded request's output
        # depends on its trees, and must not depend on what other requests generated.
        shared = self.shared if job.temperature == 0 else None
        if shared is not None and (index := shared.get(job.tenant)) is not None:
            places.append(index)
        for index in places:
            match, ends = index.occurrences(job.tokens, self.max_match, self.max_candidates)
            if match < min(self.min_match, len(job.tokens)) or not ends:
                continue
            depth = min(self.max_depth, math.ceil(self.depth_factor * match))
            tree, score = index.grow(ends, depth, budget, self.min_token_prob)
            if score > best[1]:
                best = tree, score
        return best

    def _own(self, job: DraftJob) -> SuffixIndex:
        """The sequence's index, brought up to its accepted history (rebuilt after a
        rollback); assumed tokens are matched, not indexed."""
        tokens = job.tokens[: len(job.tokens) - job.assumed]
        index = self.requests.get(job.seq_id)
        held = index.end if index is not None else 0
        stale = held > len(tokens) or (held and index.at(held - 1) != tokens[held - 1])
        if index is None or stale:
            index = self.requests[job.seq_id] = SuffixIndex()
            held = 0
        index.extend(tokens[held:])
        return index

    def forget(self, seq_id: str) -> None:
        self.requests.pop(seq_id, None)

    def learn(self, tenant: str, tokens: list[int], prompt_len: int) -> None:
        """Keeps the output, after the prompt's last max_match tokens: the context that lets a
        later request with the same ending (a template, a repeated instruction) match from
        its first output token on."""
        if self.shared is not None and len(tokens) > prompt_len:
            self.shared.add(tenant, tokens[max(0, prompt_len - self.max_match) :])

    def learned_tokens(self) -> int:
        return self.shared.tokens() if self.shared is not None else 0
