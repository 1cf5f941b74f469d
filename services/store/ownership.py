"""Orphans: requests Redis records as running on a live verifier that does not run them.

One rule, used by the scheduler (which requeues them) and by `specserve doctor` (which
reports them). A live verifier's registry entry carries its `incarnation` (new at every
start) and the ids of the requests it runs (`request_ids`, listed at `listed_ms` on its
clock). A running request is an orphan of its verifier when
- its claim is by another incarnation than the live one: the verifier restarted under the
  same id and the new process never heard of it; or
- it is missing from two of the verifier's lists in a row, though claimed more than `grace`
  before the first (a request being admitted now, or moving into the batch while the list
  is taken, is not one).
Requests of a verifier with no live entry are not orphans here: the scheduler requeues them
once the entry has been gone for `dead_verifier_grace_seconds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .requests import Claim

EARLIER_INCARNATION = "earlier_incarnation"
NOT_RUNNING = "not_running"


@dataclass(frozen=True)
class Orphan:
    claim: Claim
    reason: str  # EARLIER_INCARNATION | NOT_RUNNING
    detail: str  # for a person: what was seen


def listed(entry: dict[str, str]) -> tuple[set[str], int] | None:
    """The request ids a registry entry lists and when; None if it lists none (an older
    verifier)."""
    if "listed_ms" not in entry:
        return None
    return set(entry.get("request_ids", "").split(",")) - {""}, int(entry["listed_ms"])


class OrphanFinder:
    """Applies the rule above to successive looks at Redis. It remembers, per claim, the list
    it was first missing from."""

    def __init__(self, grace_ms: int):
        self.grace_ms = grace_ms
        self._unlisted: dict[Claim, int] = {}  # claim -> listed_ms of the first list missing it

    @property
    def suspects(self) -> int:
        """Claims missing from one list so far (an orphan if the next one misses them too)."""
        return len(self._unlisted)

    def look(self, claims: list[Claim], verifiers: dict[str, dict[str, str]]) -> list[Orphan]:
        """The orphans among `claims`, given the live registry entries by verifier id, read
        after the claims (so a claim by an incarnation newer than its entry cannot be seen)."""
        orphans, unlisted = [], {}
        for claim in claims:
            entry = verifiers.get(claim.verifier_id)
            if entry is None:
                continue
            live = entry.get("incarnation", "")
            if claim.incarnation != live:
                detail = (
                    f"claimed by incarnation {claim.incarnation or '(none)'} of verifier "
                    f"{claim.verifier_id}, which restarted as {live or '(none)'}"
                )
                orphans.append(Orphan(claim, EARLIER_INCARNATION, detail))
                continue
            seen = listed(entry)
            if seen is None:
                continue
            ids, listed_ms = seen
            if claim.request_id in ids or claim.admitted_ms >= listed_ms - self.grace_ms:
                continue
            first = self._unlisted.get(claim, listed_ms)
            unlisted[claim] = first
            if listed_ms > first:
                detail = (
                    f"verifier {claim.verifier_id} does not run it: missing from its lists of "
                    f"{listed_ms - first} ms apart, claimed {first - claim.admitted_ms} ms "
                    "before the first"
                )
                orphans.append(Orphan(claim, NOT_RUNNING, detail))
        self._unlisted = unlisted
        return orphans
