"""Placement: which waiting request goes to which verifier, and which class goes first.
Pure functions, no I/O."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..common import prefix
from ..common.capacity import admission_blocks, kv_fit_problem


@dataclass
class VerifierLoad:
    """A verifier as its last heartbeat described it (updated locally as requests are placed)."""

    verifier_id: str
    address: str
    capacity: int
    running: int
    batch_capacity: int = 0
    batch_running: int = 0
    kv_budget: int = 0  # tokens: kv_blocks * block_size
    kv_free: int = 0  # blocks it admits into now (free, less its watermark)
    block_size: int = 1
    max_seq_len: int = 0
    pool: str = "stable"
    version: str = ""  # the model version it serves (models.served_version)
    prefixes: frozenset[str] = frozenset()  # short hashes of its cached blocks (prefix.short)

    def need(self, want: Want) -> int:
        """Blocks the verifier takes from its free ones to admit the request: all of its
        prompt's, since cached blocks that nobody holds are counted as free and stop being
        free once it holds them (so this is exact or, for blocks held already, too many)."""
        return admission_blocks(want.prompt_tokens, 0, self.block_size)

    def cached_blocks(self, want: Want) -> int:
        """How many leading blocks of the request's prompt the verifier holds cached."""
        if not self.prefixes or not want.prompt_ids:
            return 0
        return prefix.cached_blocks(want.hashes(self.version, self.block_size), self.prefixes)

    def fits(self, want: Want) -> bool:
        if self.running >= self.capacity or self.need(want) > self.kv_free:
            return False
        return want.priority != "batch" or self.batch_running < self.batch_capacity

    def could_ever_hold(self, want: Want) -> bool:
        """Whether the request, alone, fits its worst case (prompt + max_tokens)."""
        return (
            kv_fit_problem(
                want.prompt_tokens,
                want.max_tokens,
                self.kv_budget,
                self.max_seq_len,
                self.block_size,
            )
            is None
        )

    def take(self, want: Want) -> None:
        self.kv_free -= self.need(want)
        self.running += 1
        self.batch_running += want.priority == "batch"


def parse_verifiers(rows: list[dict[str, str]]) -> list[VerifierLoad]:
    fields = ("running", "batch_capacity", "batch_running", "kv_budget", "kv_free")
    return [
        VerifierLoad(
            r["id"],
            r["address"],
            int(r.get("capacity", 0)),
            **{f: int(r.get(f, 0)) for f in fields},
            block_size=int(r.get("block_size", 1)),
            max_seq_len=int(r.get("max_seq_len", 0)),
            pool=r.get("pool", "stable"),
            version=r.get("version", ""),
            prefixes=frozenset(filter(None, r.get("prefixes", "").split(","))),
        )
        for r in rows
        if "address" in r and r.get("draining") != "1"
    ]


@dataclass
class Want:
    """What a waiting request needs of a verifier."""

    priority: str
    prompt_tokens: int
    max_tokens: int
    session_owner: str | None = None  # verifier its session's last turn ran on (a hint)
    pool: str | None = None  # only verifiers of this rollout pool
    version: str | None = None  # only verifiers of this model version (it started there)
    prompt_ids: list[int] | None = None  # hashed for prefix-aware placement (None: not)
    prefix_scope: str = ""  # whose cached blocks it may use (prefix.scope_of)
    _hashes: dict[tuple[str, int], list[int]] = field(default_factory=dict, repr=False)

    def eligible(self, loads: list[VerifierLoad]) -> list[VerifierLoad]:
        """The verifiers of the pool and version asked for."""
        return [
            v for v in loads if self.pool in (None, v.pool) and self.version in (None, v.version)
        ]

    def hashes(self, version: str, block_size: int) -> list[int]:
        """The prefix hashes of the prompt's blocks under `version` (computed once each), as
        a verifier's admission looks them up (all but the last prompt token)."""
        key = (version, block_size)
        if key not in self._hashes:
            ids = self.prompt_ids or []
            self._hashes[key] = prefix.block_hashes(
                ids[: len(ids) - 1], block_size, prefix.root(version, self.prefix_scope)
            )
        return self._hashes[key]


def choose_verifier(loads: list[VerifierLoad], want: Want) -> VerifierLoad | None:
    """Among the eligible verifiers (pool, version) that have room for the request: the one
    holding the longest cached prefix of its prompt (the least loaded of those that tie); with
    none, the session's verifier; else the least loaded: most free KV blocks (as a share), then
    fewest running. None if it fits nowhere now."""
    fitting = [v for v in want.eligible(loads) if v.fits(want)]
    if not fitting:
        return None

    def load(v: VerifierLoad) -> tuple[float, int]:
        return v.kv_free * v.block_size / max(1, v.kv_budget), -v.running

    cached = max(fitting, key=lambda v: (v.cached_blocks(want), *load(v)))
    if cached.cached_blocks(want):
        return cached
    for v in fitting:
        if v.verifier_id == want.session_owner:
            return v
    return max(fitting, key=load)


def class_order(streak: int, burst: int, batch_waiting: bool) -> tuple[str, ...]:
    """Interactive first, unless `burst` interactive requests were placed in a row while batch
    work waited: then one batch request goes first (batch cannot starve)."""
    if batch_waiting and streak >= burst:
        return ("batch", "interactive")
    return ("interactive", "batch")


def tenant_cap(loads: list[VerifierLoad], share: float) -> int:
    """The most slots one tenant may hold: `share` of the live verifiers' slots, at least
    one."""
    return max(1, int(share * sum(v.capacity for v in loads)))


def under_cap(tenant: str, held: Counter[str], cap: int) -> bool:
    """Whether a request of `tenant` may take one more slot (no tenant: no cap)."""
    return not tenant or held[tenant] < cap
