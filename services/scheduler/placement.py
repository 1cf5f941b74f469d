"""Placement: which waiting request goes to which verifier, and which class goes first.
Pure functions, no I/O."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..common.capacity import kv_need


@dataclass
class VerifierLoad:
    """A verifier as its last heartbeat described it (updated locally as requests are placed)."""

    verifier_id: str
    address: str
    capacity: int
    running: int
    batch_capacity: int = 0
    batch_running: int = 0
    kv_budget: int = 0
    kv_reserved: int = 0
    max_seq_len: int = 0
    pool: str = "stable"
    version: str = ""  # the model version it serves (models.served_version)

    @property
    def free_kv(self) -> int:
        return self.kv_budget - self.kv_reserved

    def need(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV tokens the verifier reserves for such a request."""
        return kv_need(prompt_tokens, max_tokens, self.max_seq_len)

    def fits(self, priority: str, kv_tokens: int) -> bool:
        if self.running >= self.capacity or kv_tokens > self.free_kv:
            return False
        return priority != "batch" or self.batch_running < self.batch_capacity

    def could_ever_hold(self, want: Want) -> bool:
        return self.need(want.prompt_tokens, want.max_tokens) <= self.kv_budget

    def take(self, priority: str, kv_tokens: int) -> None:
        self.running += 1
        self.batch_running += priority == "batch"
        self.kv_reserved += kv_tokens


def parse_verifiers(rows: list[dict[str, str]]) -> list[VerifierLoad]:
    fields = ("running", "batch_capacity", "batch_running", "kv_budget", "kv_reserved")
    return [
        VerifierLoad(
            r["id"],
            r["address"],
            int(r.get("capacity", 0)),
            **{f: int(r.get(f, 0)) for f in fields},
            max_seq_len=int(r.get("max_seq_len", 0)),
            pool=r.get("pool", "stable"),
            version=r.get("version", ""),
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
    session_owner: str | None = None  # verifier holding the session's cached prefix
    pool: str | None = None  # only verifiers of this rollout pool
    version: str | None = None  # only verifiers of this model version (it started there)

    def eligible(self, loads: list[VerifierLoad]) -> list[VerifierLoad]:
        """The verifiers of the pool and version asked for."""
        return [
            v for v in loads if self.pool in (None, v.pool) and self.version in (None, v.version)
        ]


def choose_verifier(loads: list[VerifierLoad], want: Want) -> VerifierLoad | None:
    """Among the eligible verifiers (pool, version): the session's verifier if it holds the
    session's prefix and the request fits there; else the least loaded that fits: most free
    KV budget (as a share), then fewest running. None if it fits nowhere now."""
    fitting = [
        v
        for v in want.eligible(loads)
        if v.fits(want.priority, v.need(want.prompt_tokens, want.max_tokens))
    ]
    for v in fitting:
        if v.verifier_id == want.session_owner:
            return v
    if not fitting:
        return None
    return max(fitting, key=lambda v: (v.free_kv / max(1, v.kv_budget), -v.running))


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
