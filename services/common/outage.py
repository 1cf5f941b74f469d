"""One log line per outage, not one traceback per retry.

A loop that retries a dependency (Redis) through a short outage should say that the
dependency went away and that it came back, not log a traceback per try that reads like a
crash. `OutageLog` is that: a loop calls `failed(error)` on each failed try and `succeeded()`
on each good one; it logs one WARNING when a burst of failures starts ("redis unreachable;
retrying") and one when it ends ("redis back after N failed tries").

    outage = OutageLog(log, "heartbeat")
    while running:
        try:
            store.heartbeat(...)
        except REDIS_UNREACHABLE as e:
            outage.failed(e)
        except Exception:
            log.exception("heartbeat failed")
        else:
            outage.succeeded()

Only errors of reaching Redis count: an error Redis answers with (a missing consumer group, a
script error) is not an outage and is for the caller to log in full, as are bugs.
"""

from __future__ import annotations

import logging
import time

import redis

# Redis is away or not answering (refused, reset, timed out, still loading its data), or a
# Redis Cluster is between masters (a failover or a slot migration: retry).
REDIS_UNREACHABLE = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)
# Any error of Redis or of the cluster client (whose own errors are not RedisErrors).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class OutageLog:
    """Logs the start and end of each run of failed tries of `dependency` from `where` (a
    loop's name, in the lines' `in` field). Owned by the one loop that calls it."""

    def __init__(self, log: logging.Logger, where: str, dependency: str = "redis"):
        self.log, self.where, self.dependency = log, where, dependency
        self.failures = 0  # failed tries in the current burst
        self._since = 0.0  # monotonic time of the burst's first failure

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failed(self, error: BaseException) -> None:
        """A try failed; the first of a burst logs one WARNING."""
        if self.failures == 0:
            self._since = time.monotonic()
            self.log.warning(
                f"{self.dependency} unreachable; retrying",
                extra={"in": self.where, "error": f"{type(error).__name__}: {error}"},
            )
        self.failures += 1

    def succeeded(self) -> None:
        """A try worked; the first after a burst logs one WARNING with the count."""
        if self.failures == 0:
            return
        tries = "try" if self.failures == 1 else "tries"
        self.log.warning(
            f"{self.dependency} back after {self.failures} failed {tries}",
            extra={
                "in": self.where,
                "failed_tries": self.failures,
                "outage_s": round(time.monotonic() - self._since, 2),
            },
        )
        self.failures = 0
