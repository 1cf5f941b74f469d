"""Rollout pools: which pool a new request goes to, and what share each pool gets.
Pure functions, no I/O; the share itself is held in Redis (`RequestStore.rollout`)."""

from __future__ import annotations

import hashlib

STABLE = "stable"
CANARY = "canary"
POOLS = (STABLE, CANARY)


def bucket(request_id: str) -> float:
    """Where a request id falls in [0, 1): uniform over ids, the same on every scheduler."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def by_pool(verifiers: list[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    """Registry rows of live verifiers by pool (in pool name order)."""
    out: dict[str, list[dict[str, str]]] = {}
    for v in verifiers:
        out.setdefault(v.get("pool", STABLE), []).append(v)
    return dict(sorted(out.items()))


def versions(members: list[dict[str, str]]) -> list[str]:
    """The model versions a pool's verifiers serve (one, unless it is mid-upgrade)."""
    return sorted({v.get("version", "") for v in members})


def pool_shares(live: set[str], canary_share: float) -> dict[str, float]:
    """The share of new requests each live pool gets. A share of 0 (rolled back) or 1
    (promoted) is kept even when the pool it names has no live verifier (requests wait for
    it); between the two, a pool that is down passes its share to the other."""
    shares = {STABLE: 1.0 - canary_share, CANARY: canary_share}
    up = live & shares.keys()
    if 0 < canary_share < 1 and len(up) == 1:
        return {pool: 1.0 for pool in up}
    return {pool: shares[pool] for pool in up}


def choose_pool(request_id: str, canary_share: float, live: set[str]) -> str:
    """The pool a new request runs in: the canary for the ids whose bucket is below the
    share, the stable pool for the rest (see `pool_shares` for pools that are down)."""
    want = CANARY if bucket(request_id) < canary_share else STABLE
    other = STABLE if want == CANARY else CANARY
    if 0 < canary_share < 1 and want not in live and other in live:
        return other
    return want
