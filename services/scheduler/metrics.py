"""The scheduler's Prometheus metrics (served when `metrics_port` is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SUBMITTED = Counter(
    "specserve_scheduler_submitted_total", "Requests accepted into a queue.", ["priority"]
)
REJECTED = Counter(
    "specserve_scheduler_rejected_total",
    "Requests refused at submission because their queue was full.",
    ["priority"],
)
EXPIRED = Counter(
    "specserve_scheduler_expired_total",
    "Queued requests ended by their class timeout or deadline.",
    ["priority"],
)
PLACED = Counter(
    "specserve_scheduler_placed_total",
    "Requests placed on a verifier, by priority and rollout pool.",
    ["priority", "pool"],
)
CANARY_SHARE = Gauge(
    "specserve_scheduler_canary_share",
    "Share of new requests placed on the canary pool (`specserve rollout`).",
)
PARKED = Gauge(
    "specserve_scheduler_parked",
    "Requeued requests waiting for a verifier of the model version they started on.",
)
SESSION_HITS = Counter(
    "specserve_scheduler_session_affinity_total",
    "Requests placed on the verifier their session's last turn ran on.",
)
PREFIX_PLACED = Counter(
    "specserve_scheduler_prefix_placed_total",
    "Requests placed on a verifier that holds cached blocks of their prompt.",
)
QUEUE_DEPTH = Gauge("specserve_scheduler_queue_depth", "Requests waiting.", ["priority"])
QUEUE_WAIT = Histogram(
    "specserve_scheduler_queue_wait_seconds",
    "From submission to placement.",
    ["priority"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
)
REQUEUED = Counter(
    "specserve_scheduler_requeued_total",
    "Running requests put back in their queue because their verifier does not run them, by "
    "reason: verifier_gone (its registry entry expired), earlier_incarnation (it restarted "
    "under the same id), not_running (it does not list them).",
    ["reason"],
)
RECLAIMED = Counter(
    "specserve_scheduler_reclaimed_total",
    "Queue entries taken over from a placement consumer that went quiet (XAUTOCLAIM).",
)
LIVE = Gauge(
    "specserve_scheduler_live_members",
    "Registered members with a fresh heartbeat, by kind (verifier, drafter).",
    ["kind"],
)
