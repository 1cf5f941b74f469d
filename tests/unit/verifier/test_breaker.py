"""The verifier's circuit breaker around a drafter."""

from __future__ import annotations


def test_circuit_breaker_opens_after_failures_and_retries_after_cooldown():
    from specserve.verifier.breaker import CircuitBreaker

    now = [100.0]
    breaker = CircuitBreaker(failures=2, cooldown=5.0, clock=lambda: now[0])
    breaker.failure()
    assert breaker.allow()
    breaker.failure()
    assert not breaker.allow()
    now[0] += 5.0
    assert breaker.allow()  # half-open: one trial
    breaker.failure()
    assert not breaker.allow()  # the trial failed: open again
    now[0] += 5.0
    breaker.success()
    assert breaker.allow() and breaker.failures == 0
