"""Recovery of running requests whose verifier does not run them: requeued with their progress.

Three ways a request is left so (see "Failures and recovery" in docs/design/recovery.md):
its verifier's registry entry is gone (it died), its claim is by an earlier incarnation of a
verifier that restarted under the same id, or its live verifier does not list it
(store/ownership.py). The placement loop calls `Recovery.run` every pass of its expiry
period; each requeue logs one line with its reason.
"""

from __future__ import annotations

import logging
import time

from ..common.settings import SchedulerSettings
from ..store import RequestStore
from ..store.ownership import OrphanFinder
from . import metrics

log = logging.getLogger(__name__)

VERIFIER_GONE = "verifier_gone"


class Recovery:
    def __init__(self, settings: SchedulerSettings, store: RequestStore):
        self.settings = settings
        self.store = store
        self.missing: dict[str, float] = {}  # verifier id -> when its registry entry was gone
        self.orphans = OrphanFinder(int(settings.orphan_grace_seconds * 1000))
        # verifier id -> its incarnation when last seen live (kept while its entry is gone)
        self.incarnations: dict[str, str] = {}

    def restarted(self, entry: dict[str, str]) -> bool:
        """True if a live verifier runs another incarnation than when a run last saw it:
        until the next run has requeued what the earlier one left, nothing is placed on it
        (what it left goes first)."""
        incarnation = entry.get("incarnation", "")
        return self.incarnations.get(entry["id"], incarnation) != incarnation

    def run(self) -> None:
        """Requeues the requests of verifiers gone for the grace period, and the orphans of
        live ones."""
        owners = self.store.owners()
        claims = self.store.claims(owners)  # read before the registry (see ownership.py)
        live = {v["id"]: v for v in self.store.live_verifiers()}
        metrics.LIVE.labels("verifier").set(len(live))
        metrics.LIVE.labels("drafter").set(len(self.store.live("drafter")))
        self._requeue_dead(owners, live)
        for orphan in self.orphans.look(claims, live):
            claim = orphan.claim
            requeued = self.store.requeue(
                claim.request_id, claim.verifier_id, claim.incarnation, claim.admitted_ms
            )
            if requeued:
                self._requeued(claim.request_id, claim.verifier_id, orphan.reason, orphan.detail)
        self.incarnations |= {vid: v.get("incarnation", "") for vid, v in live.items()}

    def _requeue_dead(self, owners: list[str], live: dict[str, dict[str, str]]) -> None:
        """The requests of verifiers whose registry entry has been gone (heartbeats missed)
        for `dead_verifier_grace_seconds`, whatever incarnation claimed them."""
        now = time.monotonic()
        for vid in owners:
            if vid in live:
                self.missing.pop(vid, None)
                continue
            gone = now - self.missing.setdefault(vid, now)
            if gone < self.settings.dead_verifier_grace_seconds:
                continue
            detail = f"the registry entry of verifier {vid} has been gone for {gone:.1f} s"
            for rid in self.store.owned(vid):
                if self.store.requeue(rid, vid):
                    self._requeued(rid, vid, VERIFIER_GONE, detail)
            self.store.forget_owner(vid)
            self.missing.pop(vid, None)
            self.incarnations.pop(vid, None)

    @staticmethod
    def _requeued(rid: str, vid: str, reason: str, detail: str) -> None:
        metrics.REQUEUED.labels(reason).inc()
        log.info(
            "requeued",
            extra={"request_id": rid, "verifier": vid, "reason": reason, "detail": detail},
        )
