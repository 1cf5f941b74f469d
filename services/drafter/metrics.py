"""The drafter's Prometheus metrics (served when `metrics_port` is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PROPOSE_SECONDS = Histogram(
    "specserve_drafter_propose_seconds",
    "Time to draft the trees of one step (all its sequences).",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5),
)
TREE_NODES = Histogram(
    "specserve_drafter_tree_nodes",
    "Nodes per proposed tree.",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
)
RESYNCS = Counter(
    "specserve_drafter_resyncs_total", "Sequences whose history had to be resent in full."
)
COMPILED_GRAPHS = Counter(
    "specserve_drafter_compiled_graphs_total",
    "Graphs torch.compile built for the draft model's forward (first compiles and recompiles).",
)
LEARNED_TOKENS = Gauge(
    "specserve_drafter_learned_tokens",
    "Tokens of completed outputs kept for later drafts (all tenants; suffix and hybrid).",
)
RUN_AHEAD = Counter(
    "specserve_drafter_run_ahead_total",
    "Run-ahead trees by outcome: used (the step went as assumed) or discarded.",
    ["outcome"],
)
RUN_AHEAD_SECONDS = Histogram(
    "specserve_drafter_run_ahead_seconds",
    "Time drafting ahead after a step's answer (while the verifier verifies it).",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5),
)
