"""The `suffix` proposer: suffix matching over the sequence's own history and over its
tenant's earlier outputs, after SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975).

Each step finds the longest suffix of the history (up to `max_match` tokens) that occurred
before, in two places: the request's own prompt and output (`SuffixIndex` per sequence), and
the recent completed outputs of the same tenant (`SharedOutputs`; each kept after the last
`max_match` tokens of its prompt, so that a request with the same ending matches from its first
token). What followed the occurrences of that suffix becomes a tree, grown best-first by
frequency: a child's probability is the share of its parent's occurrences that continue with
its token, a node's the product along its path. The tree's score is its expected number of
accepted tokens: those probabilities, each discounted by how long the match was
(`SuffixIndex.grow`); of the two places, the tree with the higher score is proposed. Depth
follows the match: `depth_factor` x the match length, at most `max_depth`, so a long copy
drafts deep and a short, uncertain match drafts little.

An index keeps, for each short key (the last 1, 3 and 8 tokens at a position), where it ends;
a lookup compares the latest `max_candidates` of them backwards with the history, so a step
costs at most max_candidates x max_match comparisons and budget x max_candidates to grow,
however long or repetitive the text. The shared outputs are bounded in tokens per tenant and
in tenants (the oldest tokens and the least recently used tenant go first); an index holds
about 250 bytes a token (`tests/unit/speculation/test_suffix.py` measures it), and between
compactions up to twice its bound.

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
from collections import OrderedDict

from ..common.settings import DrafterSettings
from .proposer import DraftJob, Proposer
from .tree import DraftTree

SEPARATOR = -1  # between documents of a shared index: no match or continuation crosses it
KEYS = (8, 3, 1)  # key lengths indexed, longest first: the longest key seen gives candidates


class SuffixIndex:
    """A token stream and, per key (a hash of the last 1, 3 or 8 tokens at a position), the
    positions where it ends, oldest first. With `max_tokens`, the oldest tokens leave: they
    stop counting at once, and their entries go at the next compaction, which rebuilds the
    index from what is left whenever twice max_tokens are stored (amortised O(1) a token)."""

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        self.tokens: list[int] = []  # tokens[i] is at absolute position base + i
        self.base = 0
        self.first = 0  # oldest position that counts (older ones wait for the compaction)
        self.ends: dict[int, int | list[int]] = {}

    @property
    def end(self) -> int:
        """Absolute position after the last token."""
        return self.base + len(self.tokens)

    def __len__(self) -> int:
        """Tokens that count (what max_tokens bounds; at most twice as many are stored)."""
        return self.end - self.first

    def at(self, pos: int) -> int:
        return self.tokens[pos - self.base]

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            self._index(self.end - 1)
        if self.max_tokens is not None and len(self) > self.max_tokens:
            self.first = self.end - self.max_tokens
            if self.first - self.base >= self.max_tokens:
                self._compact()

    def add_document(self, tokens: list[int]) -> None:
        self.extend([*tokens, SEPARATOR])

    def _index(self, pos: int) -> None:
        ends = self.ends
        for k in KEYS:
            key = self._key(pos, k)
            if key is None:
                continue
            held = ends.get(key)
            if held is None:
                ends[key] = pos  # most keys occur once: a bare position, not a list
            elif isinstance(held, int):
                ends[key] = [held, pos]
            else:
                held.append(pos)

    def _key(self, pos: int, k: int) -> int | None:
        """The key of the k tokens ending at pos; None where they leave the stream or cross
        a document's end. Keys are hashes: a match is always checked token by token."""
        start = pos - k + 1
        if start < self.base:
            return None
        key = tuple(self.tokens[start - self.base : pos - self.base + 1])
        return None if SEPARATOR in key else hash(key)

    def _compact(self) -> None:
        del self.tokens[: self.first - self.base]
        self.base = self.first
        self.ends = {}
        for pos in range(self.base, self.end):
            self._index(pos)

    def occurrences(
        self, context: list[int], max_match: int, max_candidates: int
    ) -> tuple[int, list[int]]:
        """The longest suffix of `context` (up to max_match tokens) that ends somewhere in the
        stream with at least one token after it, and the positions where it ends. Candidates
        come from the longest key of the context that has some (latest first, at most
        max_candidates of them looked at)."""
        for k in KEYS:
            if len(context) < k or (ends := self.ends.get(hash(tuple(context[-k:])))) is None:
                continue
            if isinstance(ends, int):
                ends = [ends]
            best, found = 0, []
            for pos in itertools.islice(reversed(ends), max_candidates):
                if pos < self.first:
                    break  # older ones no longer count
                if pos + 1 >= self.end or self.at(pos + 1) == SEPARATOR:
                    continue  # nothing followed it (yet)
                m, limit = 0, min(max_match, len(context), pos - self.base + 1)
                while m < limit and self.at(pos - m) == context[-m - 1]:
                    m += 1
                if m > best:
                    best, found = m, [pos]
                elif m == best and m:
                    found.append(pos)
            if found:
                return best, found
        return 0, []

    def grow(
        self, ends: list[int], depth: int, budget: int, min_token_prob: float, match: int
    ) -> tuple[DraftTree, float]:
        """The tree of what followed `ends` (where a suffix of `match` tokens occurred),
        best-first by frequency, and its expected accepted tokens: the sum of its nodes' path
        shares, each times match / (match + depth) (1-based depth), a rule of succession over
        the matched length; each node's term is its score (DraftTree.scores). A continuation
        seen once is a share of 1 at every depth; after a 1-token match the target kept
        0.3-0.5 of such 2-node trees, after a 20-token one most of a 40-node copy, and the
        plain shares overrated every tree 3-4x on the acceptance replay's outputs, the
        smallest the most (the hybrid proposer compares the score with the draft model's)."""
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
            tree.scores.append(-neg * match / (match + offset + 1))
            score += tree.scores[-1]
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
        index = self.indices.pop(name, None)
        if index is None:
            index = SuffixIndex(self.tokens_per_tenant)
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
        min_match: int = 1,
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
            tree, score = index.grow(ends, depth, budget, self.min_token_prob, match)
            if score > best[1]:
                best = tree, score
        return best

    def _own(self, job: DraftJob) -> SuffixIndex:
        """The sequence's index, brought up to its accepted history (rebuilt after a
        rollback); assumed tokens are matched, not indexed."""
        tokens, n = job.tokens, len(job.tokens) - job.assumed
        index = self.requests.get(job.seq_id)
        held = index.end if index is not None else 0
        stale = held > n or (held and index.at(held - 1) != tokens[held - 1])
        if index is None or stale:
            index = self.requests[job.seq_id] = SuffixIndex()
            held = 0
        index.extend(tokens[held:n])
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
