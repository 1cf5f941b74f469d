"""The registry: who serves now, found by heartbeats; and the rollout's canary share.

Owns verifier:<id> and drafter:<id> (each member's info, expiring without heartbeats), the
verifiers and drafters sets, and rollout (the share of new requests placed on the canary
pool, set by an operator). See schema.KEYS.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..common.outage import REDIS_ERRORS, REDIS_UNREACHABLE, OutageLog
from .connection import Connection
from .schema import ROLLOUT_KEY, now_ms

log = logging.getLogger(__name__)


class Registry(Connection):
    """Members (verifiers, drafters) and the canary share."""

    def heartbeat(
        self, member_id: str, info: dict[str, Any], ttl_seconds: float, kind: str = "verifier"
    ) -> None:
        """Registers a member of a kind with its info; it expires without the next beat."""
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(self.layout.members(kind), member_id)
        pipe.hset(self.layout.member(kind, member_id), mapping=info)
        pipe.pexpire(self.layout.member(kind, member_id), int(ttl_seconds * 1000))
        pipe.execute()

    def deregister(self, member_id: str, kind: str = "verifier") -> None:
        self.r.srem(self.layout.members(kind), member_id)
        self.r.delete(self.layout.member(kind, member_id))

    def live(self, kind: str) -> list[dict[str, str]]:
        """Registered members of a kind (verifier, drafter) whose heartbeat has not expired."""
        ids = sorted(self.r.smembers(self.layout.members(kind)))
        pipe = self.r.pipeline(transaction=False)
        for member in ids:
            pipe.hgetall(self.layout.member(kind, member))
        out = []
        for member, info in zip(ids, pipe.execute(), strict=True):
            if info:
                out.append({"id": member, **info})
            else:
                self.r.srem(self.layout.members(kind), member)
        return out

    def live_verifiers(self) -> list[dict[str, str]]:
        """Registered verifiers whose heartbeat has not expired."""
        return self.live("verifier")

    def largest_verifier(self) -> tuple[int, int, int] | None:
        """(kv_budget, max_seq_len, block_size) of the live verifier with the largest KV
        budget."""
        rows = [v for v in self.live_verifiers() if "kv_budget" in v]
        if not rows:
            return None
        best = max(rows, key=lambda v: int(v["kv_budget"]))
        return (
            int(best["kv_budget"]),
            int(best.get("max_seq_len", 0)),
            int(best.get("block_size", 1)),
        )

    def drafters(self, pool: str) -> list[str]:
        """Addresses of the live drafters of a rollout pool (a canary drafts for canaries)."""
        rows = self.live("drafter")
        return [d["address"] for d in rows if "address" in d and d.get("pool", "stable") == pool]

    # --- the rollout ------------------------------------------------------------------------
    def rollout(self) -> dict[str, float]:
        """The rollout: canary_share (0 to 1) and the share before the last change."""
        h = self.r.hgetall(ROLLOUT_KEY)
        return {
            "canary_share": float(h.get("canary_share", 0.0)),
            "previous_share": float(h.get("previous_share", 0.0)),
            "updated_ms": int(h.get("updated_ms", 0)),
        }

    def set_canary_share(self, share: float) -> float:
        """Sets the share of new requests placed on the canary pool; returns the old one."""
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"canary share must be within [0, 1], got {share}")
        old = self.rollout()["canary_share"]
        self.r.hset(
            ROLLOUT_KEY,
            mapping={"canary_share": share, "previous_share": old, "updated_ms": now_ms()},
        )
        return old


def heartbeat_forever(
    store: Registry,
    kind: str,
    member_id: str,
    info: Callable[[], dict[str, Any]],
    period: float,
    stop: threading.Event,
) -> None:
    """Keeps a member registered (ttl: three periods) until `stop` is set; then removes it.
    A Redis outage logs one line when it starts and one when it ends."""
    outage = OutageLog(log, f"{kind} heartbeat")
    while not stop.is_set():
        try:
            store.heartbeat(member_id, info(), ttl_seconds=3 * period, kind=kind)
        except REDIS_UNREACHABLE as e:
            outage.failed(e)
        except Exception:
            log.exception("heartbeat failed", extra={"kind": kind})
        else:
            outage.succeeded()
        stop.wait(period)
    try:
        store.deregister(member_id, kind)
    except REDIS_ERRORS:
        log.warning("deregistration failed; the entry expires", extra={"kind": kind})
