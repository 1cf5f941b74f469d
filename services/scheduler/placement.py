"""Placement: which waiting request goes to which verifier. Pure functions, no I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VerifierLoad:
    verifier_id: str
    address: str
    capacity: int
    running: int

    @property
    def free(self) -> int:
        return self.capacity - self.running


def parse_verifiers(rows: list[dict[str, str]]) -> list[VerifierLoad]:
    return [
        VerifierLoad(r["id"], r["address"], int(r.get("capacity", 0)), int(r.get("running", 0)))
        for r in rows
        if "address" in r
    ]


def choose_verifier(loads: list[VerifierLoad]) -> VerifierLoad | None:
    """The verifier with the most free slots (ties: fewest running); None if all are full."""
    free = [v for v in loads if v.free > 0]
    if not free:
        return None
    return max(free, key=lambda v: (v.free, -v.running))
