"""A circuit breaker per drafter: stop asking a drafter that keeps failing, try again later."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class CircuitBreaker:
    """Closed until `failures` consecutive failures; then open for `cooldown` seconds, after
    which one trial is allowed (half-open): success closes it, failure opens it again."""

    def __init__(self, failures: int, cooldown: float, clock=time.monotonic):
        self.threshold, self.cooldown, self.clock = failures, cooldown, clock
        self.failures = 0
        self.opened_at: float | None = None

    @property
    def is_open(self) -> bool:
        """Open and still cooling down: nothing goes through."""
        return not self.allow()

    def allow(self) -> bool:
        return self.opened_at is None or self.clock() - self.opened_at >= self.cooldown

    def half_open(self) -> None:
        """Lets a trial through now, as if the cooldown had passed (the drafter is back)."""
        if self.opened_at is not None:
            self.opened_at = self.clock() - self.cooldown

    def success(self) -> None:
        self.failures, self.opened_at = 0, None

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            if self.opened_at is None:
                log.warning("drafter breaker open", extra={"failures": self.failures})
            self.opened_at = self.clock()
