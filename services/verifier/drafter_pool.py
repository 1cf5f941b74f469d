"""The drafters one verifier streams with (configured and discovered), a stream and a breaker
for each, and which drafter each sequence drafts with."""

from __future__ import annotations

import hashlib
import logging
import time

from ..common.outage import REDIS_UNREACHABLE, OutageLog
from . import metrics
from .breaker import CircuitBreaker
from .drafter_client import DrafterClient

log = logging.getLogger(__name__)

TENANT_SLACK = 2  # sequences more than the least loaded drafter a tenant's home may hold


def registered_drafters(store, pool: str) -> dict[str, str]:
    """The live drafters of a rollout pool in the registry: address -> when that drafter
    process started (`started_ms`; "" if its entry does not say)."""
    return {
        d["address"]: d.get("started_ms", "")
        for d in store.live("drafter")
        if "address" in d and d.get("pool", "stable") == pool
    }


class DrafterPool:
    """The drafters one verifier streams with: the configured ones plus those registered in
    Redis (`discover`: address -> start time, refreshed every `refresh_seconds`), each with
    its own breaker.

    A sequence sticks to the drafter that holds its draft state while that drafter is usable;
    a new one (or one whose drafter failed or left) goes to its tenant's home drafter (the
    same on every verifier, by rendezvous hash: the one that holds the tenant's completed
    outputs for suffix drafts) unless that one holds more than TENANT_SLACK sequences over
    the least loaded, and then to the usable drafter with the fewest sequences; it resyncs
    there. A drafter that comes back (registered again after its entry
    was gone, or with a new start time: a restarted process) gets a trial at once instead of
    waiting out its breaker's cooldown."""

    def __init__(
        self,
        addresses: list[str],
        discover,
        breaker: tuple[int, float],
        refresh_seconds: float = 1.0,
        clock=time.monotonic,
    ):
        self.static = list(addresses)
        self.discover = discover
        self.breaker_args = breaker
        self.refresh_seconds = refresh_seconds
        self.clock = clock
        self.clients: dict[str, DrafterClient] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.assigned: dict[str, str] = {}  # sequence id -> drafter address
        self.registered: dict[str, str] = {}  # address -> start time, at the last discovery
        self._refreshed = -float("inf")
        self._outage = OutageLog(log, "drafter discovery")
        self._set(self.static)

    def refresh(self) -> None:
        if self.discover is None or self.clock() - self._refreshed < self.refresh_seconds:
            return
        self._refreshed = self.clock()
        try:  # the registry is an addition: without it, keep the drafters we have
            found = self.discover()
        except REDIS_UNREACHABLE as e:
            self._outage.failed(e)
            return
        except Exception as e:
            log.warning("drafter discovery failed", extra={"error": str(e)})
            return
        self._outage.succeeded()
        self._set(self.static + [a for a in found if a not in self.static])
        for address, started in found.items():
            back = self.registered.get(address) != started  # new, returned or restarted
            if back and address in self.breakers and self.breakers[address].is_open:
                log.info("drafter back; breaker half-open", extra={"address": address})
                self.breakers[address].half_open()
        self.registered = dict(found)

    def _set(self, addresses: list[str]) -> None:
        for address in addresses:
            if address not in self.clients:
                log.info("drafter added", extra={"address": address})
                self.clients[address] = DrafterClient(address)
                self.breakers[address] = CircuitBreaker(*self.breaker_args, clock=self.clock)
        for address in [a for a in self.clients if a not in addresses]:
            log.info("drafter removed", extra={"address": address})
            self.clients.pop(address).close()
            del self.breakers[address]
        metrics.DRAFTERS.set(len(self.clients))

    def assign(self, seq_id: str, tenant: str | None = None) -> str | None:
        """The drafter for a sequence this step; None if no drafter is usable. A sequence
        with a tenant (the empty one too) goes home within the slack; None: least loaded."""
        current = self.assigned.get(seq_id)
        if current in self.clients and self.breakers[current].allow():
            return current
        usable = [a for a in self.clients if self.breakers[a].allow()]
        if not usable:
            return None
        load = {a: 0 for a in usable}
        for address in self.assigned.values():
            if address in load:
                load[address] += 1
        chosen = min(usable, key=lambda a: (load[a], usable.index(a)))
        if tenant is not None:
            home = max(usable, key=lambda a: hashlib.blake2b(f"{tenant}|{a}".encode()).digest())
            if load[home] <= load[chosen] + TENANT_SLACK:
                chosen = home
        self.assigned[seq_id] = chosen
        return chosen

    def release(self, seq_id: str) -> None:
        """The sequence ended: it no longer counts in its drafter's load."""
        self.assigned.pop(seq_id, None)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
