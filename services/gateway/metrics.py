"""The gateway's Prometheus metrics (served when `metrics_port` is set): what clients see."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "specserve_gateway_requests_total",
    "Generate calls by priority, how they ended (finish reason or gRPC status code) and the "
    "rollout pool that served them (none: ended before it ran).",
    ["priority", "status", "pool"],
)
TTFT = Histogram(
    "specserve_gateway_ttft_seconds",
    "From the Generate call to its first token, as the client sees it.",
    ["priority", "pool"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
TPOT = Histogram(
    "specserve_gateway_time_per_output_token_seconds",
    "Mean time between output tokens of a request after its first.",
    ["priority", "pool"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2),
)
DELIVERY = Histogram(
    "specserve_gateway_delivery_delay_seconds",
    "From a batch of tokens' commit to Redis (its output stream entry's time, on Redis's clock)"
    " to the gateway's handing it to the client's stream (its message made); entries "
    "written before their stream opened (a re-attach's catch-up) are not counted.",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
OUTPUT_TOKENS = Counter("specserve_gateway_output_tokens_total", "Tokens streamed to clients.")
DRAFTED = Counter(
    "specserve_gateway_drafted_tokens_total",
    "Draft tokens proposed for finished requests, by rollout pool.",
    ["pool"],
)
ACCEPTED = Counter(
    "specserve_gateway_accepted_tokens_total",
    "Draft tokens the target accepted for finished requests, by rollout pool "
    "(acceptance = accepted / drafted).",
    ["pool"],
)
OPEN_STREAMS = Gauge("specserve_gateway_open_streams", "Generate streams open now.")
HTTP_RESPONSES = Counter(
    "specserve_gateway_http_responses_total",
    "Responses of the OpenAI-compatible HTTP API, by route and HTTP status.",
    ["route", "code"],
)
AWAITING_REQUEST = Gauge(
    "specserve_gateway_calls_awaiting_request",
    "Calls whose key was checked from their headers and whose request message (gRPC) or body "
    "(HTTP) has not arrived yet; each key has at most its concurrent streams of them.",
)
